"""The Kubernetes objects the operator creates, built from the custom resources (pure).

One module per thing built, so a reader looking for a pod finds it by where it runs:
`hub` (a run's trainer, feed, evaluator and its regions' mirrors), `rollout` (a run's
workers on a region's lent GPUs), `inferencepool` (a serving pool's canary set and
feedback Secret), `envpool` (an EnvPool's session servers); `common` holds what they all
share (labels, owners, least privilege). Callers import from those modules: this package
re-exports nothing.
"""
