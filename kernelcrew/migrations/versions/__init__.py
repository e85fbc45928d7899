"""Migration scripts, written by hand and reviewed: one file per revision, oldest first."""
