"""What a run reports: metrics.jsonl (`metrics`), experiment trackers (`tracking`), printed
tables (`tables`), the progress bar (`progress`) and curves.png (`plots`)."""
