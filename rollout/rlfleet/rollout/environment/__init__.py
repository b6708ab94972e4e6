"""What a rollout acts in and is graded by: the agent loop, its tools and sandbox, tasks,
rewards and cheat detection."""
