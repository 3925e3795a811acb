"""
The processes of a run and how they agree: a value of every rank, a vote, one line for an error that one rank met
(failing_together) or that one rank died of (failing_alone). It imports torch only inside the functions: fineweb.py,
which never runs distributed, should not wait a second to import it.
"""

import contextlib
import re

from machinery.errors import UsageError, chain


def before_any_process_group():
    """Imports torch.distributed.nn while no process group exists. Imported after one (as DDP does), its group.WORLD
    default arguments keep the group and its gloo threads alive past destroy_process_group, and a gloo thread alive
    at exit can abort the process."""
    import torch.distributed.nn  # noqa: F401


def every_rank(value):
    """[each rank's value], on every rank; [value] in a single process. All ranks must call it."""
    import torch.distributed as dist  # here, not at the top: see the module's docstring

    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def first_error_of_any_rank(error):
    """The first rank's error message (or None), on every rank: a rank that stopped alone would leave the others
    waiting in their next collective, forever under NCCL, or dying in it with tracebacks. All ranks must call it."""
    return next((e for e in every_rank(error) if e is not None), None)


# how a collective breaks as a process in it dies: gloo's connection to it closed or reset, NCCL's ncclRemoteError
PEER_DIED = r"Connection closed by peer|Connection reset by peer|Broken pipe|remote process exited"


def dead_peer(error):
    """Which rank died, in words ("rank 1", or "another rank" among more than two), if error (or one it was raised
    from) is a collective that broke as that rank's process died; else None."""
    import torch.distributed as dist  # here, not at the top: see the module's docstring

    for link in chain(error):
        if isinstance(link, RuntimeError) and re.search(PEER_DIED, str(link)):
            return f"rank {1 - dist.get_rank()}" if dist.get_world_size() == 2 else "another rank"
    return None


@contextlib.contextmanager
def failing_alone(after_a_death):
    """For work that one rank may fail in alone while the others wait in a collective of it (out of memory in a
    training step, whose backward pass the others reduce gradients in), where the ranks cannot vote as in
    failing_together: a UsageError raised inside leaves its line in the process group's store (torchrun's agent's, or
    rank 0's), and a rank whose collective broke as that rank left (gloo's "Connection closed by peer") raises that
    line instead. A rank that died leaving no line (kill -9, the kernel's out-of-memory killer) leaves the others one
    that says so, then after_a_death(): what is kept, and what to do. Under NCCL such a collective may hang until
    torchrun stops the rank."""
    import torch.distributed as dist  # here, not at the top: see the module's docstring

    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    store = dist.distributed_c10d._get_default_store() if several else None  # no public name for the group's own
    try:
        yield
    except UsageError as e:
        if store is not None:
            store.set(f"error/{dist.get_rank()}", str(e))
        raise
    except Exception as e:
        if store is None:
            raise
        keys = [f"error/{rank}" for rank in range(dist.get_world_size())]
        try:
            error = next((store.get(key).decode() for key in keys if store.check([key])), None)
        except RuntimeError:  # the store left with its rank (rank 0's, outside torchrun)
            error = None
        if error is None and (dead := dead_peer(e)) is not None:
            error = (f"{dead} died (killed, perhaps by the kernel's out-of-memory killer, or failed: its own output "
                     f"says why); {after_a_death()}")
        if error is None:
            raise
        raise UsageError(error) from None


def any_rank(flag, device):
    """True on every rank if flag is True on any of them."""
    import torch  # here, not at the top: see the module's docstring
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flag
    votes = torch.tensor(float(flag), device=device)
    dist.all_reduce(votes)
    return votes.item() > 0


@contextlib.contextmanager
def failing_together(decided=None, apart=None):
    """A UsageError raised inside on any rank stops every rank with it: raised on one rank alone, as by work only rank 0
    does, it would leave the others waiting in their next collective. Every rank must enter; it is also a barrier.
    decided: what this rank decided inside, called on the way out; apart(every rank's) says in one line where they
    differ (None where they agree), which then stops every rank instead, as it explains any error it led to."""
    error = None
    try:
        yield
    except UsageError as e:
        error = str(e)
    gathered = every_rank((error, decided() if decided else None))
    error = apart([mine for _, mine in gathered]) if apart else None
    error = error or next((e for e, _ in gathered if e is not None), None)
    if error is not None:
        raise UsageError(error)


def in_words(ranks):
    """Ranks, in words: "rank 2", "ranks 0-1", "ranks 0, 2-3"."""
    spans = []
    for rank in sorted(ranks):
        if spans and spans[-1][1] == rank - 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(
        str(first) if first == last else f"{first}-{last}" for first, last in spans)
