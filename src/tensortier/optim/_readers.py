"""Make the readers of parameters wait for writes that ``step()`` left running.

Two options let ``step()`` return before every parameter holds its new value: ``defer_gather``
(the sharded all-gathers run on a thread, ``_zero.DeferredWrites``) and ``defer_write_back`` (the
host-to-device copies run on a side stream, ``DeferredWriteBack`` below). Both need the same
interception, written once here:

- a global forward pre-hook (``register_module_forward_pre_hook``: the optimizer is given
  parameters, not modules) calls ``wait_for(module)`` before a module runs; a module waits for the
  parameters it holds itself, not its children's (the root module would wait for everything),
  except PyTorch's own modules whose forward reads their children's parameters without calling
  the children (``_SUBTREE_READERS``: ``nn.MultiheadAttention`` reads ``out_proj``'s, the
  transformer layers' inference fast path reads every parameter of the layer, ``nn.DataParallel``
  replicates them all), which wait for all the parameters under them;
- a ``state_dict`` pre-hook and a ``load_state_dict`` pre-hook on every module holding one of
  the parameters (registered the first time a forward reaches the module's root) call
  ``synchronize()``, so ``model.state_dict()`` is current and ``model.load_state_dict()`` (a
  rollback, ``Checkpointer.restore``) is not undone by a pending write landing after it.

Under ``torch.compile`` the hook runs eagerly (a graph break per module call); making one calls
``torch.compiler.reset()`` when dynamo is loaded, since dynamo does not guard on module hooks
(``skip_nnmodule_hook_guards``) and code compiled before would never call it.

Not covered: reading a parameter directly (``p.norm()``), or through a module whose forward is
not called; the optimizer's ``synchronize()`` is for those.
"""

from __future__ import annotations

import abc
import functools
import logging
import sys
import weakref

import torch

from tensortier.transfer.streams import consume

log = logging.getLogger("tensortier.optim.adamw")


def _before_forward(ref: weakref.ref, module: torch.nn.Module, args) -> None:
    readers = ref()
    if readers is not None:
        readers.before_use(module)


def _before_state_dict(ref: weakref.ref, module: torch.nn.Module, *args) -> None:
    readers = ref()
    if readers is not None:
        readers.synchronize()


# forwards that read parameters of submodules they do not call (``params_read``)
_SUBTREE_READERS = (
    torch.nn.MultiheadAttention,
    torch.nn.TransformerEncoderLayer,
    torch.nn.TransformerDecoderLayer,
    torch.nn.DataParallel,  # replicate() broadcasts every parameter, the replicas hold copies
)


def params_read(module: torch.nn.Module):
    """The parameters ``module``'s forward reads before any of its children's forwards run."""
    if isinstance(module, _SUBTREE_READERS):
        return module.parameters()
    return (p for p in module._parameters.values() if p is not None)


class ParamReaders(abc.ABC):
    """The hooks; subclasses say how to wait (``wait_for``, ``synchronize``)."""

    def __init__(self):
        self._params: set[int] = set()  # every parameter of the optimizer (by id)
        self._seen: weakref.WeakSet = weakref.WeakSet()  # modules already walked
        self._hooked: weakref.WeakSet = weakref.WeakSet()  # modules with a state-dict pre-hook
        # run eagerly under torch.compile: a traced wait would be a no-op in the graph (and dynamo
        # cannot trace the weak sets); the cost is a graph break at each module call. Wrapped
        # here, not at import: torch.compiler.disable imports dynamo (~0.9 s)
        compiled_before = "torch._dynamo" in sys.modules
        hook = torch.compiler.disable(functools.partial(_before_forward, weakref.ref(self)))
        self.hooks: list = [torch.nn.modules.module.register_module_forward_pre_hook(hook)]
        if compiled_before:
            # dynamo does not guard on module hooks (``skip_nnmodule_hook_guards``): code compiled
            # before this hook existed would never call it. Dropped, it recompiles with the hook
            log.info("tensortier: torch.compiler.reset() so compiled modules call the wait hook")
            torch.compiler.reset()

    def add_params(self, params) -> None:
        """Parameters to watch for (a new param group: every module is walked again)."""
        self._params.update(id(p) for p in params)
        self._seen = weakref.WeakSet()

    def before_use(self, module: torch.nn.Module) -> None:
        """A module is about to run: it waits for its own parameters."""
        if module not in self._seen and self._params:
            self._watch(module)
        self.wait_for(module)

    @abc.abstractmethod
    def wait_for(self, module: torch.nn.Module) -> None:
        """Before ``module`` runs: wait for the writes of the parameters its forward reads."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait for every pending write (``state_dict``, ``load_state_dict``, the optimizer)."""

    def _watch(self, root: torch.nn.Module) -> None:
        """State-dict and load-state-dict pre-hooks on the modules under ``root`` that hold one of
        the parameters."""
        for m in root.modules():
            if m in self._seen:
                continue
            self._seen.add(m)
            if m not in self._hooked and any(id(p) in self._params for p in m._parameters.values()):
                self._hooked.add(m)
                hook = functools.partial(_before_state_dict, weakref.ref(self))
                self.hooks.append(m.register_state_dict_pre_hook(hook))
                self.hooks.append(m.register_load_state_dict_pre_hook(hook))

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()


class DeferredWriteBack(ParamReaders):
    """``defer_write_back=True``: ``step()`` returns with the parameters' host-to-device copies
    still queued on the optimizer's side stream (``_staging.Staging.write_back``), and a module's
    forward makes the device's current stream wait for the copies of the parameters it holds: a
    device-side wait (``wait_event``), the host never blocks. The copies are issued in forward
    order (``_step.Step``), so the next forward's first layers wait only for their own and later
    layers' copies overlap the layers before them. This is FSDP2's pattern for its all-gathers
    (a pre-forward wait on the event of the copy that fills the module's parameters)."""

    def __init__(self):
        super().__init__()
        self._events: dict[int, tuple[torch.device, object]] = {}  # id(param) -> its copy's event

    def written(self, params: list[torch.Tensor], event) -> None:
        """``params``' copies are queued; ``event`` completes after them."""
        for p in params:
            self._events[id(p)] = (p.device, event)

    @property
    def pending(self) -> int:
        return len(self._events)

    def wait_for(self, module: torch.nn.Module) -> None:
        if not self._events:
            return
        waited: set[int] = set()
        for p in params_read(module):
            entry = self._events.pop(id(p), None)
            if entry is not None and id(entry[1]) not in waited:
                waited.add(id(entry[1]))
                self._wait(*entry)

    def synchronize(self) -> None:
        """Work queued from now on the current streams runs after every pending copy."""
        events, self._events = self._events, {}
        for device, event in {id(e): (d, e) for d, e in events.values()}.values():
            self._wait(device, event)

    @staticmethod
    def _wait(device: torch.device, event) -> None:
        # device-side (streams.consume): no record_stream, a parameter is never freed under it
        consume(event, torch.cuda.current_stream(device))
