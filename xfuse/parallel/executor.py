"""The loop that runs one rank's program (``xfuse.parallel.schedule.protocol``) over the runs of its requests.

The program is the pure order of the rank's actions (post receives, compute a task, issue its sends, wait for them);
the executor carries it out: each task's work is its request's run (``xfuse.parallel.request_run``), in its request's
stage state (``xfuse.parallel.request_state``), a slot's sends and the receives posted after it go out in one
coalesced exchange, and with cancellation a stopped request's actions are skipped (``xfuse.parallel.stops``).
"""

from __future__ import annotations

from xfuse.comm.p2p import P2PChannels, Recv, Send
from xfuse.parallel.request_run import RequestRun
from xfuse.parallel.request_state import RequestStates
from xfuse.parallel.schedule import COLLECT, Action, Message, Task
from xfuse.parallel.stops import RunStops
from xfuse.parallel.trace import COMM, COMPUTE
from xfuse.runtime.host_deadline import HostDeadline


class ProgramExecutor:
    """Runs a rank's ``program`` (``xfuse.parallel.schedule.protocol``) over the runs of the requests in it: one
    request alone, or a stream of them (``Task.request`` indexes ``runs``; each task's work is its request's run,
    in its request's stage state, switched by ``states``). A slot's sends and the receives posted after it go out
    in one coalesced exchange, whichever requests they belong to, in the program's order: messages between two
    ranks match in issue order."""

    def __init__(
        self,
        runs: list[RequestRun],
        program,
        channels: P2PChannels | None,
        *,
        states: RequestStates | None = None,
        stops: RunStops | None = None,
        host_deadline: HostDeadline | None = None,
    ):
        self.runs, self.program, self.channels, self.states = runs, program, channels, states
        self.stops = stops  # with cancellation: where this rank learns whether each request stops
        self.host_deadline = host_deadline  # ages the host between tasks (comm.host_timeout_s)

    def _use(self, request: int) -> None:
        if self.states is not None:
            self.states.use(request)

    def execute(self) -> None:
        program, stops, deadline = self.program, self.stops, self.host_deadline
        last_of_step = [
            {t.step: t for t in run.schedule.orders[run.pipe_rank] if t.hop != COLLECT} for run in self.runs
        ]
        prepare: tuple[int, int] | None = None  # (request, pipelined step) whose per-step work is due after the sends

        def runs(index: int) -> bool:  # with cancellation: the turn at ``index`` taken, whether its action runs
            return stops is None or stops.runs(index, program[index][1])

        i = 0
        while i < len(program):
            if not runs(i):  # a stopped request: no task of the step it stopped before, or a later one, runs
                i += 1
                continue
            action, task = program[i]
            if prepare is not None and action not in (Action.SEND, Action.POST):
                request, step = prepare
                if stops is None or stops.reaches(step, request):
                    due = self.runs[request]
                    with due.span(f"s{step} prepare", COMPUTE, step=step, prepare=True):
                        self._use(request)
                        due.stage.prepare_step(due.conditioning(step))
                prepare = None
            if action in (Action.SEND, Action.POST):  # coalesce a task's sends with the next posts: one batch call
                send_tasks: list[Task] = []
                post_tasks: list[Task] = []
                while i < len(program) and program[i][0] in (Action.SEND, Action.POST):
                    if stops is not None and stops.may_wait(i):  # what is collected goes before a wait
                        self._exchange(send_tasks, post_tasks)
                        send_tasks, post_tasks = [], []
                    if not runs(i):
                        i += 1
                        continue
                    (send_tasks if program[i][0] == Action.SEND else post_tasks).append(program[i][1])
                    i += 1
                self._exchange(send_tasks, post_tasks)
                continue
            run = self.runs[task.request]
            if action == Action.WAIT_SEND and task in run.sends:
                with run.span("send wait", COMM, step=task.step, patch=task.patch, **run.which(task)):
                    for handle in run.sends.pop(task):
                        handle.wait()
                if deadline is not None:
                    deadline.beat((Action.WAIT_SEND, task))
            elif action == Action.COMPUTE:
                self._use(task.request)
                run.compute(task)
                if deadline is not None:
                    deadline.beat((Action.COMPUTE, task))
                if last_of_step[task.request].get(task.step) == task:
                    if run.request.on_progress is not None:
                        run.request.on_progress(task.step)
                    # the next step's first patch need not carry its per-step work: done here, after this task's
                    # sends, while the other ranks compute (pipelined steps: patch passes on the whole batch)
                    if run.cache is None and run.schedule.warmup_steps <= task.step + 1 < run.schedule.num_steps:
                        prepare = (task.request, task.step + 1)
            # WAIT_RECV is folded into COMPUTE: the buffers are waited for right before use.
            i += 1
        for request, stop in {} if stops is None else stops.stopped.items():
            if self.runs[request].recvs or self.runs[request].sends:  # the stop points guarantee neither
                raise RuntimeError(f"request {request}, stopped before step {stop}, left messages in flight")

    def _exchange(self, send_tasks: list[Task], post_tasks: list[Task]) -> None:
        """Issue ``send_tasks``' outgoing messages and post ``post_tasks``' receives in one coalesced call."""
        sends: list[Send] = []
        send_owner: list[Task] = []
        for task in send_tasks:
            run = self.runs[task.request]
            for m, tensor in run.outgoing.pop(task, {}).items():
                if self.stops is not None and not self.stops.reaches(m.needed_at, task.request):
                    continue  # a stopped request runs no task of that step: nobody receives it
                sends.append(run.send(m, tensor))
                send_owner.append(task)
        recvs: list[Recv] = []
        posted: list[Message] = []
        for task in post_tasks:
            for m in self.runs[task.request].recv_msgs[task]:
                recvs.append(self.runs[task.request].recv(m))
                posted.append(m)
        if not sends and not recvs:
            return
        channels = self.channels
        assert channels is not None  # messages flow only between ranks, and then the engine has channels
        send_handles, recv_handles = channels.exchange(sends, recvs)
        for task, sent in zip(send_owner, send_handles, strict=True):
            self.runs[task.request].sends.setdefault(task, []).append(sent)
        for m, received in zip(posted, recv_handles, strict=True):
            self.runs[m.request].recvs[m] = received
