"""Records: what a run leaves behind: history.csv and run.json (``history``), checkpoints
(``checkpoint``), the code and data a run used (``provenance``), live curves (``live_curves``),
per-run metrics (``metrics``) and the folder locks that keep two writers apart (``locks``)."""
