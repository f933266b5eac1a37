"""The ledger record of a parallel-path step (``rlvr_fast.ledger.records``, the Parallel-Shapley
arms): R responses of K paths, all forked from the prompt, recorded like a flat step over the
R K paths (category "flat", ``rewards`` the paths' returns of ``rlvr_fast.credit.paths``), with
a ``parallel`` section (``ParallelStats``): phi, its standard error, U(N), U(∅), r_out, the
utility calls and, under the summary aggregator, each summary's prompt length (prompt +
serialised paths) and length. Summaries add to the counts: gen = leaf + sum L_s;
pref = R K L_p + sum L_sp; pad_pref = R K L_p + R_s max L_sp; untrim_gen = R K max L_i + R_s max
L_s; bwd_out = leaf + sum L_s and bwd_full = R K L_p + leaf + sum (L_sp + L_s) on backward steps;
decode_rows = sum (L_i - 1) + sum (L_s - 1) and prefill_run = L_p + sum (L_sp - L_p) (one prompt
prefill, each summary runs only its serialised paths) unless the engine preempted.

Its laws beyond every question's (``ParallelRecord.kind_laws``): the flat laws with the summary
terms above; one phi and one standard error per path, one U(N), U(∅) and r_out per response,
one summary per response or none; Shapley steps are efficient (sum_j phi_rj = U_r(N) - U_r(∅)),
exact ones scored all R 2^K coalitions; every path's reward is lambda_p normalise(phi)_j +
lambda_o r_out,r and every summary's lambda_o r_out,r (``rlvr_fast.credit.paths``). Homogeneous:
the paths' rewards agree and so do the summaries'. In a step of several questions (one line)
the engine counts are the step's, checked there (``rlvr_fast.ledger.laws``)."""

from __future__ import annotations

from dataclasses import dataclass

from rlvr_fast.credit.paths import normalise
from rlvr_fast.engine.counters import EngineCounters
from rlvr_fast.ledger.records import StepRecord, register_record
from rlvr_fast.rollouts.pairs import PairCategory


@dataclass
class ParallelStats:
    """A parallel-path step's section of its ledger line: K, how credit was computed, per path
    phi and its standard error (response-major), per response U(N), U(∅) and r_out, the
    distinct coalitions scored, and the summaries (prompt lengths with the serialised paths,
    lengths, rewards; empty under the vote aggregator)."""

    paths_per_response: int
    aggregator: str
    path_utility: str
    path_credit: str
    permutations: int
    path_reward_norm: str
    lambda_outcome: float
    lambda_path: float
    phi: list[float]
    phi_se: list[float]
    utility_full: list[float]
    utility_empty: list[float]
    r_out: list[float]
    utility_calls: int
    summary_prompt_lens: list[int]
    summary_lengths: list[int]
    summary_rewards: list[float]


@register_record
@dataclass(kw_only=True)
class ParallelRecord(StepRecord):
    """A parallel-path step's line: its ``parallel`` section."""

    parallel: ParallelStats

    def __post_init__(self) -> None:
        if isinstance(self.parallel, dict):  # a line read back from JSON
            self.parallel = ParallelStats(**self.parallel)
        elif not isinstance(self.parallel, ParallelStats):
            raise TypeError(f"parallel is {self.parallel!r}, not an object")

    def beyond_leaves(self) -> tuple[int, int]:
        """The summaries: their tokens, and their prompts (serialised paths) with them."""
        summaries = sum(self.parallel.summary_lengths)
        return summaries, sum(self.parallel.summary_prompt_lens) + summaries

    def rewards_agree(self) -> bool:
        return super().rewards_agree() and len(set(self.parallel.summary_rewards)) <= 1

    def expected_decode_rows(self) -> int:
        return sum(n - 1 for n in self.lengths) + sum(n - 1 for n in self.parallel.summary_lengths)

    def kind_laws(self, require, engine_counts: bool) -> None:
        stats, paths, cap = self.parallel, len(self.lengths), self.max_new_tokens
        k = stats.paths_per_response
        require(k >= 1 and paths % k == 0, "whole responses of K paths")
        responses = paths // k
        require(
            all(p[0] == p[1] == 0 and p[6] == PairCategory.FLAT for p in self.pairs),
            "parallel paths are flat pairs: pl = 0",
        )
        require(
            len(stats.phi) == len(stats.phi_se) == paths, "one phi and one standard error per path"
        )
        require(
            len(stats.utility_full) == len(stats.utility_empty) == len(stats.r_out) == responses,
            "one U(N), U(∅) and r_out per response",
        )
        summaries, contexts = stats.summary_lengths, stats.summary_prompt_lens
        require(
            len(summaries)
            == len(contexts)
            == len(stats.summary_rewards)
            == (responses if stats.aggregator == "summary" else 0),
            "one summary per response under the summary aggregator, none otherwise",
        )
        require(all(1 <= n <= cap for n in summaries), "1 <= L_s <= max_new_tokens")
        require(all(n > self.prompt_len for n in contexts), "a summary prompt extends the prompt")
        require(1 <= stats.utility_calls <= responses << k, "1 <= utility calls <= R 2^K")
        exact = stats.path_credit == "shapley" and stats.permutations == 0
        require(
            not exact or stats.utility_calls == responses << k, "exact Shapley scores all R 2^K"
        )
        for r in range(responses):
            phi = stats.phi[r * k : (r + 1) * k]
            if stats.path_credit == "shapley":
                scale = max(1.0, abs(stats.utility_full[r]), abs(stats.utility_empty[r]))
                require(
                    abs(sum(phi) - (stats.utility_full[r] - stats.utility_empty[r]))
                    <= 1e-9 * k * scale,
                    "Shapley efficiency: sum_j phi_rj = U_r(N) - U_r(∅)",
                )
            expected = (
                stats.lambda_path * normalise(phi, stats.path_reward_norm)
                + stats.lambda_outcome * stats.r_out[r]
            ).tolist()
            require(
                all(
                    abs(a - b) <= 1e-5 for a, b in zip(self.rewards[r * k : (r + 1) * k], expected)
                ),
                "path reward = lambda_p normalise(phi)_j + lambda_o r_out",
            )
        require(
            all(
                abs(s - stats.lambda_outcome * r) <= 1e-6
                for s, r in zip(stats.summary_rewards, stats.r_out)
            ),
            "summary reward = lambda_o r_out",
        )
        require(self.gen == self.leaf + sum(summaries), "gen = leaf + sum L_s")
        require(self.pref == paths * self.prompt_len + sum(contexts), "pref = R K L_p + sum L_sp")
        require(
            self.pad_pref == paths * self.prompt_len + len(contexts) * max(contexts, default=0),
            "pad_pref = R K L_p + R_s max L_sp",
        )
        require(
            self.untrim_gen
            == paths * max(self.lengths) + len(summaries) * max(summaries, default=0),
            "untrim_gen = R K max L + R_s max L_s",
        )
        if not engine_counts:  # a question of a multi-question step: the step's engine work
            return
        require(
            self.preemptions > 0 or self.decode_rows == self.expected_decode_rows(),
            "decode work = sum(L_i - 1) + sum(L_s - 1): no decode after EOS",
        )
        require(
            self.preemptions > 0
            or self.prefill_run == self.prompt_len + sum(n - self.prompt_len for n in contexts),
            "prefill_run = L_p + sum (L_sp - L_p): the prompt once, each summary its paths",
        )


def parallel_step_record(
    *,
    step: int,
    question_id: str,
    rewards: list[float],
    sigma_r: float,
    homogeneous: bool,
    active: bool,
    optimizer_step: bool,
    prompt_len: int,
    lengths: list[int],
    parallel: ParallelStats,
    executed: EngineCounters,
    max_new_tokens: int,
    params: int,
    loss: float | None,
    grad_norm: float | None,
    seconds: dict[str, float],
) -> ParallelRecord:
    """The ledger line of a parallel-path step: ``lengths`` and ``rewards`` (returns) per path,
    response-major; ``homogeneous``: no token had a nonzero advantage."""
    paths = len(lengths)
    leaf = sum(lengths)
    summaries, contexts = parallel.summary_lengths, parallel.summary_prompt_lens
    pairs = [
        [0, 0, lengths[i], lengths[i + 1], rewards[i], rewards[i + 1], PairCategory.FLAT.value]
        for i in range(0, paths - 1, 2)
    ]
    return ParallelRecord(
        step=step,
        question_id=question_id,
        rewards=rewards,
        sigma_r=sigma_r,
        homogeneous=homogeneous,
        active=active,
        optimizer_step=optimizer_step,
        pairs=pairs,
        prompt_len=prompt_len,
        lengths=lengths,
        gen=leaf + sum(summaries),
        pref=paths * prompt_len + sum(contexts),
        pad_pref=paths * prompt_len + len(contexts) * max(contexts, default=0),
        untrim_gen=paths * max(lengths) + len(summaries) * max(summaries, default=0),
        leaf=leaf,
        bwd_out=leaf + sum(summaries) if active else 0,
        bwd_full=paths * prompt_len + leaf + sum(contexts) + sum(summaries) if active else 0,
        max_new_tokens=max_new_tokens,
        params=params,
        loss=loss,
        grad_norm=grad_norm,
        seconds=seconds,
        parallel=parallel,
        **executed.to_json(),
    )
