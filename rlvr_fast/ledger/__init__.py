"""The per-step ledger (seed §5.1): records, their conservation laws, the writer."""
