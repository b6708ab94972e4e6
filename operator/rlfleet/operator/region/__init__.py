"""The region role: one reconciler per kind the region operator watches.

- `pool_reconciler`: InferencePools. Lends a production pool's replicas to mirrored RLRuns
  off-peak and takes them back, recording each decision before acting on it;
  `pool_status` says, purely, what the pool's status and events are afterwards.
- `mirror_reconciler`: RLRun mirrors (the hub's copies of its runs). Gives a run's pods
  their spec and EnvPool token, and reports the GPUs it holds here back to the hub.
- `envpool_reconciler`: EnvPools. Sizes a pool's session servers from what they say
  (`rlfleet.operator.envpools` plans it) and builds their objects.

A namespace's mirrors and pools are read by all three; `common` holds those shared reads,
each listed object parsed into its api model where it is read. This package re-exports
nothing: callers import the module they need.
"""
