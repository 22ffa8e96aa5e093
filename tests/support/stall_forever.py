"""A rank that stalls inside an xfuse frame (the stall fault) until it is ended, with its stacks on SIGUSR1 as
``xfuse generate``'s: the GPU suite's launch-limit test."""

if __name__ == "__main__":
    from xfuse.runtime.faults import _fire
    from xfuse.runtime.host_deadline import register_stack_dump

    register_stack_dump()
    _fire("stall", 0, "the GPU suite's launch-limit test")
