"""The loop that runs one rank's program (``xfuse.parallel.protocol.protocol``) over the runs of its requests.

The program is the pure order of the rank's actions (post receives, compute a task, issue sends, wait for them);
the executor carries it out: each task's work is its request's run (``xfuse.parallel.request_run``), in its request's
stage state (``xfuse.parallel.request_state``), the sends and posts between two computes go out in one coalesced
call in the program's order (the one order of messages that every rank keeps), and with cancellation a stopped
request's actions are skipped (``xfuse.parallel.stops``).
"""

from __future__ import annotations

from xfuse.comm.p2p import P2PChannels, Recv, Send
from xfuse.parallel.protocol import Action, Program, served_step
from xfuse.parallel.request_run import RequestRun
from xfuse.parallel.request_state import RequestStates
from xfuse.parallel.schedule import COLLECT, Message, Task
from xfuse.parallel.stops import RunStops
from xfuse.parallel.trace import COMM, COMPUTE
from xfuse.runtime.host_deadline import HostDeadline


class ProgramExecutor:
    """Runs a rank's ``program`` (``xfuse.parallel.protocol.protocol``) over the runs of the requests in it: one
    request alone, or a stream of them (``Task.request`` indexes ``runs``; each task's work is its request's run,
    in its request's stage state, switched by ``states``). The sends and posts between two computes go out in one
    coalesced call, whichever requests they belong to, in the program's order: messages between two ranks match in
    issue order, and every rank issues in the one order of messages."""

    def __init__(
        self,
        runs: list[RequestRun],
        program: Program,
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
            item = program[index][1]
            return stops is None or stops.runs(index, served_step(item), item.request)

        i = 0
        while i < len(program):
            if not runs(i):  # a stopped request: no task of the step it stopped before, or a later one, runs
                i += 1
                continue
            action, item = program[i]
            # a step's per-step work runs at the request's first action here (not a post or send) that serves the
            # step: past its stop point, so a request stopped before the step never prepares it
            if (
                prepare is not None
                and action not in (Action.SEND, Action.POST)
                and item.request == prepare[0]
                and served_step(item) >= prepare[1]
            ):
                request, step = prepare
                if stops is None or stops.reaches(step, request):
                    due = self.runs[request]
                    with due.span(f"s{step} prepare", COMPUTE, step=step, prepare=True):
                        self._use(request)
                        due.stage.prepare_step(due.conditioning(step))
                prepare = None
            if action in (Action.SEND, Action.POST):  # the sends and posts up to the next compute: one call
                ops: list[tuple[Action, Message]] = []
                while i < len(program) and program[i][0] in (Action.SEND, Action.POST):
                    if stops is not None and stops.may_wait(i):  # what is collected goes before a wait
                        self._issue(ops)
                        ops = []
                    if runs(i):
                        ops.append(program[i])  # type: ignore[arg-type]
                    i += 1
                self._issue(ops)
                continue
            run = self.runs[item.request]
            if action == Action.WAIT_SEND and item in run.sends:
                assert isinstance(item, Message)
                label = f"send wait {item.channel} to r{item.dst}"
                with run.span(label, COMM, step=item.step, patch=item.patch, **run.which(item)):
                    run.sends.pop(item).wait()
                if deadline is not None:
                    deadline.beat((Action.WAIT_SEND, item))
            elif action == Action.COMPUTE:
                task = item
                assert isinstance(task, Task)
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

    def _issue(self, ops: list[tuple[Action, Message]]) -> None:
        """Issue the sends and post the receives of ``ops`` in one coalesced call, in their order."""
        if not ops:
            return
        channels = self.channels
        assert channels is not None  # messages flow only between ranks, and then the engine has channels
        outgoing: list[Send | Recv] = []
        for action, m in ops:
            run = self.runs[m.request]
            if action == Action.SEND:
                outgoing.append(run.send(m, run.outgoing.pop(m)))
            else:
                outgoing.append(run.recv(m))
        for (action, m), handle in zip(ops, channels.issue(outgoing), strict=True):
            if action == Action.SEND:
                self.runs[m.request].sends[m] = handle  # type: ignore[assignment]
            else:
                self.runs[m.request].recvs[m] = handle  # type: ignore[assignment]
