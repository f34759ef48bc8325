"""DataLoaderX: a DataLoader that loads ahead in a background thread and, on CUDA, copies each
batch to the GPU on a side stream, so the next batch's copy overlaps the current step's compute.

    loader = DataLoaderX(device, dataset, batch_size=64, sampler=sampler, num_workers=4, pin_memory=True)
    for images, targets in loader:     # already on `device`
        ...

    loader = DataLoaderX(device, dataset, ..., on_device=decode)   # decode(cpu_batch) -> batch on `device`

Guarantees: the same batches in the same order as the DataLoader it extends; an exception raised
while loading (in a worker or in the thread) is re-raised in the loop, never swallowed or hung on;
leaving the loop early (break, exception) stops the thread once nothing else holds the iterator (an islice or
a tqdm around the loader holds it until they go, or the next iter(): one thread at a time shares the side stream),
and with it the DataLoader's workers, unless
persistent_workers=True: then the DataLoader keeps its iterator and workers for the next epoch, as long as it lives.
on_device (recipes/gpu_decode.py: decode JPEGs on the GPU) replaces the copy: it runs in the thread, on
CUDA with the side stream current, and the loop's stream waits for all it queued there before the
batch is handed out (an event recorded after it), so no step reads a batch that is still being made.
"""

import copy
import functools
import queue
import threading
import traceback
import weakref

import torch
from torch.utils.data import DataLoader

_END = object()


class _Failure:
    def __init__(self, exc):
        self.exc = exc


def _to_device(batch, device):
    """Each tensor of a batch on `device`, in the containers default_collate gives (their types kept, as
    pin_memory keeps them: a namedtuple, an OrderedDict); anything else as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)  # async only from pinned memory: pass pin_memory=True
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple takes its fields one by one
        return type(batch)(*(_to_device(b, device) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        moved = copy.copy(batch)  # its own type (OrderedDict, defaultdict), then each value moved
        moved.update({k: _to_device(v, device) for k, v in batch.items()})
        return moved
    return batch


def _record_stream(batch, stream):
    # The copy was allocated on the side stream; tell the caching allocator the compute stream uses it
    # too, or its memory could be handed to the next copy while this step still reads it.
    if isinstance(batch, torch.Tensor):
        batch.record_stream(stream)
    elif isinstance(batch, (list, tuple)):
        for b in batch:
            _record_stream(b, stream)
    elif isinstance(batch, dict):
        for b in batch.values():
            _record_stream(b, stream)


def _put(q, stop, item):
    while not stop.is_set():  # a timeout, not a blocking put: a consumer that left must not strand us
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            pass
    return False


def _produce(box, q, stop, device, stream, on_device):
    # A plain function, not a method: a thread holding the iterator would keep it alive after `break`.
    # It holds the only reference to the DataLoader iterator (popped from `box`), so the iterator, and
    # with it the worker processes, is shut down here when this function returns, not at some later
    # garbage collection (which can even run inside a freshly forked worker of the next epoch).
    # persistent_workers=True: the DataLoader holds it too (its _iterator), and its workers outlive us.
    batches = box.pop()
    try:
        if stream is not None:
            torch.cuda.set_device(device)  # the current device is per thread and defaults to GPU 0
        for batch in batches:
            event = None
            if stream is not None:
                with torch.cuda.stream(stream):
                    batch = on_device(batch)
                    event = torch.cuda.Event()
                    event.record(stream)  # after all on_device queued: the loop's stream waits for it
            else:
                batch = on_device(batch)
            if stop.is_set() or not _put(q, stop, (batch, event)):
                return
        _put(q, stop, (_END, None))
    except BaseException as exc:  # re-raised in the consumer's loop
        traceback.clear_frames(exc.__traceback__)  # its frames would keep `batches` alive
        del batches
        _put(q, stop, (_Failure(exc), None))


class _PrefetchIterator:
    def __init__(self, batches, device, depth, on_device, stream):
        self.device = device
        self.queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=_produce, args=([batches], self.queue, self.stop, device, stream,
                                                             on_device),
                                       name="DataLoaderX-producer", daemon=True)
        self.thread.start()

    def __iter__(self):
        return self

    def __next__(self):
        with torch.profiler.record_function("data"):  # --profile: the training thread waits for a batch
            return self._next()

    def _next(self):
        if self.stop.is_set():
            raise StopIteration
        while True:
            try:
                item, event = self.queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self.thread.is_alive() and self.queue.empty():  # it may have put its last item just now
                    self.close()
                    raise RuntimeError("DataLoaderX: the prefetch thread ended without a batch or an error") from None
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.exc
        if event is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(event)  # this batch's copy is done before the step reads it
            _record_stream(item, compute)
        return item

    def close(self):
        self.stop.set()
        while True:  # drop prefetched batches so their memory is freed now
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=10)

    def __del__(self):
        self.close()


class DataLoaderX(DataLoader):
    """DataLoader plus background prefetch to `device` (see module docstring). prefetch: batches ahead.
    on_device: a function from a batch as the DataLoader gives it to the batch on `device` (default: copy its
    tensors there)."""

    def __init__(self, device, *args, prefetch=2, on_device=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # the thread must set a definite GPU
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.prefetch = prefetch
        self.on_device = on_device or functools.partial(_to_device, device=self.device)  # no cycle through self
        self.stream = None  # CUDA: the side stream, made at the first iter() and kept
        self._last = None  # a weak reference to the last iter()'s iterator

    def __iter__(self):
        # One side stream for every epoch: the caching allocator keeps a freed block for the stream it was made on,
        # so a new stream each epoch (torch lends one of a pool of 32) would strand each epoch's batch memory as
        # reserved and unusable (timm's PrefetchLoader did: pytorch-image-models#2781).
        if self.device.type == "cuda" and self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        # One thread at a time on that stream: the last iterator's is stopped first (an epoch cut short by an islice
        # leaves it making batches until it is dropped; on_device's work would then interleave with the new one's
        # on the stream, after gpu_decode's drain and before nvjpeg writes)
        last = self._last() if self._last is not None else None
        if last is not None:
            last.close()
        batches = _PrefetchIterator(super().__iter__(), self.device, self.prefetch, self.on_device, self.stream)
        self._last = weakref.ref(batches)
        return batches
