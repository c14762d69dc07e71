"""megatron-core's checkpoint writer reporting its results through an in-process queue."""

from __future__ import annotations


def use_in_process_results_queue() -> None:
    """Hand write results through a plain in-process queue.

    megatron-core's writer collects results in a queue served by a ``spawn`` multiprocessing
    manager, which exists for its asynchronous (persistent worker) saves. We save synchronously,
    so results are put and taken in this process; and a spawned manager re-runs the user's
    ``__main__`` (a Python-API script without an ``if __name__ == "__main__"`` guard trains twice).
    """
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not isinstance(filesystem_async._results_queue, queue.Queue):
        filesystem_async._results_queue = queue.Queue()
