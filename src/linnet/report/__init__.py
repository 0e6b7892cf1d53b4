"""What a run reports: a `Step` per optimizer step and the run's `History` (`history`),
metrics.jsonl (`metrics`), experiment trackers (`tracking`), printed tables (`tables`),
the progress bar (`progress`) and curves.png (`plots`)."""
