"""Running work and watching it: a training job as a child process whose output streams into the log (jobs.py),
a stage submitted to a Ray cluster as a Ray Job (ray_jobs.py), progress lines every consumer parses the same way
(progress.py), TensorBoard / W&B trackers (tracking.py), where a role's tensors live and its peak memory
(devices.py), which of them hold device memory (residency.py) and the test hooks a job reads from its environment
(faults.py). Knows nothing of training methods or rollouts."""
