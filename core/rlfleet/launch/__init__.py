"""What each component runs with: its run's RLRun spec plus where it was placed.

The operator mounts the run's spec into every pod it makes (`pods.SPEC_FILE`, the ConfigMap
`<run>-spec`) and says where the pod sits in environment variables (`pods.Placement`);
`rlfleet run` places the same components as local processes. Both turn the spec into
settings (`from_spec`), so a spec field means the same thing wherever the run trains.
Settings are typed (`settings`, a production run's in `production`); `components` names
the programs that run them and how each starts.
"""
