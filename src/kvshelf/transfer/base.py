"""The copy-engine interface the worker uses: stores, loads, and one step's loads layer by layer.

An engine moves whole KV blocks of one rank between vLLM's KV cache tensors and the pages of
the server's arena (a page holds one block of every layer, packed as :class:`KVCacheLayout`
says). The worker role (:mod:`kvshelf.roles.worker`) sees engines only through
:class:`TransferEngine`, :class:`TransferHandle` and :class:`LayerwiseLoad`; it gets them from
:mod:`kvshelf.transfer.factory`, which picks the engine for the KV cache tensors' device.

Threads in the worker (an engine must be safe under exactly this use):

- any thread builds an engine (the worker attaches from its store thread too);
- the step loop calls :meth:`TransferEngine.start` in each step, before it uses the engine;
- the store thread calls :meth:`TransferEngine.store` and waits for its handle;
- the step loop (vLLM's model runner thread) calls :meth:`TransferEngine.begin_loads`, then
  :meth:`LayerwiseLoad.wait_layer` before each attention layer reads its KV cache (or for the
  last layer only, before a forward pass that calls no layer hook); the loads' page locks are
  released once :meth:`LayerwiseLoad.finished` says so (asked by the step loop, then by the
  worker's settle thread: nobody waits for the device);
- the load thread calls :meth:`LayerwiseLoad.run` on every layer-wise load, in order, as soon
  as it can (it may be late: its core may be busy);
- the step loop closes an engine (after waiting for every layer-wise load it began), possibly
  while the store thread is storing through it.

This module holds interfaces only: it imports neither an engine nor vLLM.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

import torch

from kvshelf.transfer.layout import KVCacheLayout

IndexLike = Sequence[int] | torch.Tensor
"""Block ids or page indices: a sequence of ints or a 1-D integer tensor."""


class TransferHandle(ABC):
    """A batch of block copies submitted to a :class:`TransferEngine`."""

    @abstractmethod
    def done(self) -> bool:
        """Return whether the copies have finished (never blocks)."""

    @abstractmethod
    def wait(self) -> None:
        """Block until the copies have finished.

        Raises:
            Exception: whatever made the copies fail; the destination is then undefined.
        """

    def order_compute(self) -> None:
        """Make the work the caller enqueues next on its current stream (vLLM's forward pass)
        run after these copies: a device-side wait for an asynchronous engine, never blocking
        the host; a host wait by default."""
        self.wait()


class NotReady(ValueError):
    """A copy the engine cannot make now without waiting, or cannot make at all for these
    pages (for example, pages not pinned yet, or in a chunk CUDA refused to pin): a load is a
    miss for the step, a store is dropped. Not a fault: the engine logged the cause once."""


class CompletedTransfer(TransferHandle):
    """The handle of a batch that was copied synchronously, before it was returned."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


COMPLETED = CompletedTransfer()
"""The handle every synchronous engine returns."""


class LayerwiseLoad(ABC):
    """One step's loads into vLLM's KV cache, put in place one layer at a time.

    Made by :meth:`TransferEngine.begin_loads`. Layers are numbered in layout order
    (``KVCacheLayout.layers``); "layer ``i`` is in place" means layer ``i`` of every load that
    has not failed holds its pages' data. Putting layer 0 of every load in place first, then
    layer 1, and so on, lets the forward pass run layer ``i`` while later layers copy.

    Who calls what:

    - :meth:`run`: the worker's load thread, once, possibly late (after waits began, or after
      :meth:`wait_all` returned), possibly never (a stalled thread). It starts the copies that
      have not started yet. A synchronous engine copies there; an asynchronous one may only
      enqueue the copies (for example on a side CUDA stream, recording an event per layer) and
      return before they finish. The calling thread is the worker's, not the engine's: an
      engine that needs a device context sets it itself.
    - :meth:`wait_layer` and :meth:`wait_all`: the step loop, one thread, concurrently with
      :meth:`run`; layers may be waited for in any order, and more than once.
    - :meth:`finished`: the step loop after the last layer's :meth:`wait_layer`, then the
      worker's settle thread (polling), concurrently with :meth:`run`.
    - :meth:`failures`: the step loop after the last layer's :meth:`wait_layer`, then the
      settle thread.

    Neither side may depend on the other to make progress: a wait for a layer that :meth:`run`
    has not reached starts that layer's copies itself, so waits return even if :meth:`run`
    never runs, and :meth:`run` after the last wait does nothing harmful.

    Failures: a load whose arguments are invalid, or whose copy of some layer raises, fails
    alone; the other loads go on, and every layer of the batch still completes. A failed load's
    blocks hold undefined data (in any layer, including layers already waited for); the caller
    reports them to vLLM, which recomputes them. Waits never raise for a failed load.
    """

    @abstractmethod
    def run(self) -> None:
        """Start every copy nobody has started yet, in layer order (the load thread's call)."""

    @abstractmethod
    def wait_layer(self, layer: int) -> None:
        """Return once layers ``0..layer`` are in place for whatever the caller does next.

        For host reads (a CPU engine), the bytes are written when this returns. For work the
        caller enqueues afterwards on its current device stream (a CUDA engine), it is enough
        that this stream is made to wait for those layers' copies (an event), without blocking
        the host.

        Args:
            layer: a layer index in layout order.
        """

    @abstractmethod
    def wait_all(self) -> None:
        """Block the host until every copy of every load has finished, reading the arena
        included: the caller then releases the pages' locks, and the server may reuse them.
        :meth:`failures` is final once this returns.

        Also makes every layer in place, as :meth:`wait_layer` of the last layer does.
        """

    def finished(self) -> bool:
        """Whether every copy has finished, reading the arena included (never blocks): the
        caller may then release the pages' locks. Asked only after the last layer's
        :meth:`wait_layer`; a host engine has copied everything by then, hence the default.
        """
        return True

    @abstractmethod
    def failures(self) -> Mapping[int, BaseException]:
        """The loads that failed so far: their index in ``begin_loads``'s ``loads`` -> why.

        Complete, but for a copy that raises on the device's time (none of kvshelf's engines),
        once the last layer's :meth:`wait_layer` returned; final once :meth:`finished` says
        True or :meth:`wait_all` returned.
        """


class TransferEngine(ABC):
    """Moves KV blocks of one rank between vLLM's KV cache tensors and arena pages.

    ``store`` and ``load`` validate their arguments and submit the copies; the returned handle
    tells when the copies are finished. A synchronous engine copies before it returns and hands
    back :data:`COMPLETED`; an asynchronous one (for example a CUDA engine copying on a side
    stream into a pinned, registered arena) returns a handle backed by an event.
    ``begin_loads`` submits one step's loads to be put in place layer by layer
    (:class:`LayerwiseLoad`).

    Contract for callers:

    - Commit a store's reservation only after its handle is done; release a load's lock only
      after its handle is done, or its layer-wise load is ``finished`` (until then the pages
      are still being written or read).
    - Do not reuse the destination blocks or pages of an unfinished copy.
    - Argument errors (lengths, ranges, duplicate destinations) raise at submission and copy
      nothing (``begin_loads`` reports them as that load's failure instead).
    - Close the engine only after every layer-wise load begun on it was waited for.

    An engine is thread-safe: see the module doc for the threads that use it.
    """

    def __init__(self, layout: KVCacheLayout) -> None:
        self.layout = layout

    def start(self) -> None:  # noqa: B027 (optional hook, a no-op by default)
        """Make the CUDA calls (or start the threads that make them) the engine needs before
        it copies: the step loop calls this in each step before it uses the engine, so never
        while vLLM captures CUDA graphs (it does that before its first step, with torch's
        global capture mode, in which another thread's CUDA call can invalidate the capture).
        The worker may build an engine on its store thread at any time, so an engine that
        makes CUDA calls makes none when it is built. Until it has started, :meth:`store` and
        :meth:`load` raise :class:`NotReady` and :meth:`begin_loads` fails every load with it.
        Returns at once once started.

        Raises:
            UnsupportedKVCache: the engine cannot work here (and never will: every later call
                raises it again).
        """

    def forward_fence(self) -> object | None:
        """Mark the end of this step's forward pass, for stores submitted after it.

        The step loop calls it once the forward pass that computed a step's blocks was issued
        (vLLM's ``wait_for_save``) and hands the result to :meth:`store` as ``after``. A
        synchronous engine returns None (the forward pass has finished); an asynchronous one
        returns an event recorded on the caller's current stream.
        """
        return None

    @abstractmethod
    def store(
        self, block_ids: IndexLike, page_indices: IndexLike, *, after: object | None = None
    ) -> TransferHandle:
        """Copy KV blocks ``block_ids[i]`` (all layers) into arena pages ``page_indices[i]``.

        Args:
            block_ids: vLLM block ids to read.
            page_indices: arena page indices to write, as many as ``block_ids``, distinct.
            after: a :meth:`forward_fence`: the copies start after it. None: after all work
                on the device issued so far (an asynchronous engine then waits for it).

        Returns:
            A handle; the pages hold the blocks once it is done. Its ``wait`` raises if the
            engine was closed before the copies finished.

        Raises:
            ValueError: mismatched lengths, duplicate pages, or an engine that is closed.
            IndexError: a block id or page index out of range.
        """

    @abstractmethod
    def load(self, page_indices: IndexLike, block_ids: IndexLike) -> TransferHandle:
        """Copy arena pages ``page_indices[i]`` into KV blocks ``block_ids[i]`` (all layers).

        Args:
            page_indices: arena page indices to read.
            block_ids: vLLM block ids to write, as many as ``page_indices``, distinct.

        Returns:
            A handle; the blocks hold the pages' data once it is done.

        Raises:
            ValueError: mismatched lengths, duplicate block ids, or an engine that is closed.
            IndexError: a block id or page index out of range.
        """

    @abstractmethod
    def begin_loads(self, loads: Sequence[tuple[IndexLike, IndexLike]]) -> LayerwiseLoad:
        """Submit one step's loads, to be put in place layer by layer.

        Never raises for one load's sake: a load that ``load`` would reject is reported by
        the returned object's ``failures`` instead, and the others go on.

        Args:
            loads: per load, ``(page_indices, block_ids)`` as :meth:`load` takes them; the
                loads write distinct blocks.

        Returns:
            The layer-wise load; see :class:`LayerwiseLoad` for who calls what on it.
        """

    def close(self) -> None:  # noqa: B027 (optional hook, a no-op by default)
        """Drop every reference to the KV cache and the arena (so the arena can be unmapped).

        Waits for copies running in other threads; a store still running fails (it raises,
        or its handle's ``wait`` does), so its pages are never committed.
        """
