"""What a user runs: notebooks (generated from the studies' configs), widget apps, the live
charts, the Voila dashboard, the report, sweeps, `reproduce` and `gpu-check`."""
