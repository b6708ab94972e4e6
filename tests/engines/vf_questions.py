"""A verifiers taskset as its users write one (installed on the worker's path): its own
task data, its own rubric of weighted reward functions, nothing of rlfleet's."""

import verifiers.v1 as vf


class Question(vf.TaskData):
    answer: str


class Ask(vf.Task[Question]):
    @vf.reward(weight=0.5)
    async def replied(self, trace: vf.Trace) -> float:
        return 1.0 if trace.last_reply else 0.0

    @vf.reward(weight=0.5)
    async def correct(self, trace: vf.Trace) -> float:
        return float(self.data.answer in trace.last_reply)


class Questions(vf.Taskset[Ask, vf.TasksetConfig]):
    def load(self):
        yield Ask(Question(id="apple", prompt="What is the secret number of apple?", answer="7"))


__all__ = ["Questions"]
