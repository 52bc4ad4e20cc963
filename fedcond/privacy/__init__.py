"""Privacy: sample-level DP-SGD, the DP fingerprint and the privacy ledger (``dp``), the secure
aggregation settings (``secure_aggregation``), and the fingerprint inversion attack (``attack``)."""
