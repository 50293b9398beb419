"""Training jobs: the DeepSpeed entry point (entry), batches and data order (batches), checkpoints on the
store (checkpoints), and the parent side that launches a job and commits its model (launch)."""
