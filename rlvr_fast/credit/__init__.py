"""Credit: pure functions from rewards to per-token weights. Tree credit (``tree``), path
credit (``paths``) over Shapley attributions (``shapley``), and the generative judge whose
utility path credit may use (``judge``)."""
