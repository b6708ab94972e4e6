"""The rollout worker: tasks in, groups of attempts run on the pod's engines, trajectories out."""
