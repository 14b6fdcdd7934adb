"""What the trainer keeps on disk: atomic checkpoints (full or sharded), the checkpoint directories
(torch-free), the run's final model, the trainer's step record and its recording of trained batches."""
