"""The run's message bus: NATS keys and JWTs (`credentials`), who may do what
(`permissions`), connecting as a user (`connection`), and the run's JetStream streams,
declared once (`streams`). Below the components and the local run, above the types of
`rlfleet.api`."""
