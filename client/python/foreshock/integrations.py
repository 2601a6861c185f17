"""Foreshock in trainers that own the training loop: Hugging Face
transformers' Trainer and Lightning.

    from foreshock.integrations import ForeshockCallback
    trainer = transformers.Trainer(model=model, args=args, train_dataset=ds,
                                   callbacks=[ForeshockCallback(run="exp-42")])
    trainer.train()

    from foreshock.integrations import ForeshockLightningCallback
    trainer = lightning.pytorch.Trainer(max_steps=1000,
                                        callbacks=[ForeshockLightningCallback(run="exp-42")])
    trainer.fit(module, loader)

Each callback makes one foreshock.Monitor when training starts (keywords
given to the callback go to Monitor: endpoint=, run=, windows=, ...; the
callback supplies the model), calls Monitor.step once per optimizer step
with the trainer's step count, and closes it when training ends. The
monitor is the callback's `monitor` attribute while it runs; `stats` holds
Monitor.close()'s counts afterwards.

transformers and lightning are imported only when a callback class is first
used, so this module imports without them.

Training is never stopped by monitoring: Monitor's own errors at
construction (a bad argument, no run id) are raised when training starts,
before the first step; an exception from a later Monitor call is logged
once with its traceback and monitoring stops (the `error` attribute holds
it), while training goes on.
"""
import logging

import torch

log = logging.getLogger("foreshock")

__all__ = ["ForeshockCallback", "ForeshockLightningCallback"]


class _Guarded:
    """A Monitor made at training start whose later failures stop only
    monitoring."""

    def __init__(self, monitor_options):
        if "model" in monitor_options:
            raise ValueError("the callback passes the trainer's model to Monitor: drop model=")
        self.options = dict(monitor_options)
        self.monitor = None
        self.stats = None
        self.error = None

    def _start(self, model, **defaults):
        if self.monitor is not None:
            return
        from .monitor import Monitor
        self.stats = self.error = None
        self.monitor = Monitor(model, **{**defaults, **self.options})

    def _call(self, what, fn, *args, **kwargs):
        if self.monitor is None or self.error is not None:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # monitoring must never stop training
            self.error = e
            log.exception("foreshock: %s failed; monitoring stops here, training goes on", what)
            return None

    def _step(self, step, **scalars):
        self._call("Monitor.step", self.monitor.step if self.monitor else None, step,
                   **{k: v for k, v in scalars.items() if v is not None})

    def _close(self):
        mon, self.monitor = self.monitor, None
        if mon is None:
            return
        try:
            self.stats = mon.close()
        except Exception as e:
            self.error = self.error or e
            log.exception("foreshock: Monitor.close failed")


def _unwrap(model):
    """The user's module inside DistributedDataParallel / DataParallel."""
    while isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        model = model.module
    return model


def _scalar(v):
    return v.detach() if isinstance(v, torch.Tensor) else v


class _TrainerHooks(_Guarded):
    """ForeshockCallback(**monitor_options): a transformers TrainerCallback.

        trainer = transformers.Trainer(model=model, args=args, train_dataset=ds,
                                       callbacks=[ForeshockCallback(run="exp-42")])

    on_train_begin makes Monitor(model, **monitor_options) from the
    Trainer's model and optimizer (accelerate's wrapper; Monitor sends the
    class name of the torch optimizer inside it, unless monitor_options
    has optimizer_name=); on_step_end calls Monitor.step(state.global_step, ...)
    once per optimizer step with the learning rate used in that step; on a
    step the Trainer logs (logging_steps), the call waits for its on_log and
    carries the logged loss and grad_norm too (the Trainer's loss is the
    mean since the previous log: logging_steps=1 gives each step's loss, as
    the daemon's loss rules expect); on_train_end closes the Monitor.
    """

    def __init__(self, **monitor_options):
        _Guarded.__init__(self, monitor_options)
        self._pending = None   # (step, lr) of a step waiting for its on_log
        self._lr = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._pending, self._lr = None, None
        # optimizer: the rate Monitor reads when on_optimizer_step never ran
        # (transformers before that event).
        opt = optimizer if getattr(optimizer, "param_groups", None) else None
        self._start(_unwrap(model), **({"optimizer": opt} if opt is not None else {}))

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is not None and getattr(optimizer, "param_groups", None):
            self._lr = optimizer.param_groups[0].get("lr")

    def _flush(self, loss=None, grad_norm=None):
        if self._pending is not None:
            step, lr = self._pending
            self._pending = None
            self._step(step, loss=loss, grad_norm=grad_norm, lr=lr)

    def on_step_end(self, args, state, control, **kwargs):
        self._flush()   # a logged step whose log never came
        if control.should_log:
            self._pending = (state.global_step, self._lr)
        else:
            self._step(state.global_step, lr=self._lr)

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if self._pending is not None and ("loss" in logs or "grad_norm" in logs):
            self._flush(loss=logs.get("loss"), grad_norm=logs.get("grad_norm"))

    def on_train_end(self, args, state, control, **kwargs):
        self._flush()
        self._close()


class _LightningHooks(_Guarded):
    """ForeshockLightningCallback(**monitor_options): a Lightning Callback.

        trainer = lightning.pytorch.Trainer(
            max_steps=1000, callbacks=[ForeshockLightningCallback(run="exp-42")])

    on_train_start makes Monitor(pl_module, optimizer=trainer.optimizers[0],
    **monitor_options) (its class name goes to the daemon, unless
    monitor_options has optimizer_name=), and under DDP with node_ranks= this node's ranks
    (Lightning's launcher sets no LOCAL_WORLD_SIZE for Monitor to find
    them); on_before_optimizer_step takes the gradient norm
    (before clipping, as a device tensor: no sync) and the learning rate of
    that step; on_train_batch_end calls Monitor.step(trainer.global_step,
    loss=..., grad_norm=..., lr=...) once per optimizer step (not per
    accumulated micro-batch), the loss being that of the micro-batch that
    completed the step as training_step returned it (its "loss" when it
    returns a dict; Lightning's division by accumulate_grad_batches undone);
    on_fit_end (or on_exception) closes the Monitor.
    """

    def __init__(self, **monitor_options):
        _Guarded.__init__(self, monitor_options)
        self._last_step = None
        self._grad_norm = self._lr = None
        self._grad_norm_failed = False

    def on_train_start(self, trainer, pl_module):
        self._last_step, self._grad_norm, self._lr = None, None, None
        opts = getattr(trainer, "optimizers", None) or []
        defaults = {"optimizer": opts[0]} if opts else {}
        node = _node_ranks(trainer)
        if node:
            defaults["node_ranks"] = node
        self._start(pl_module, **defaults)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.monitor is None or self.error is not None:
            return
        self._lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
        try:
            self._grad_norm = _grad_norm(pl_module)
        except Exception as e:  # e.g. gradients of mixed meshes: the step goes without it
            self._grad_norm = None
            if not self._grad_norm_failed:
                self._grad_norm_failed = True
                log.warning("foreshock: no grad_norm from this model's gradients (%s); pass "
                            "it yourself with Monitor.step if needed", e)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step == self._last_step:
            return   # a micro-batch of an accumulated step
        self._last_step = step
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, (torch.Tensor, float, int)):
            loss = None
        elif getattr(pl_module, "automatic_optimization", False):
            # Lightning hands on training_step's loss divided by the
            # accumulation count; the daemon gets the loss itself.
            loss = _scalar(loss) * getattr(trainer, "accumulate_grad_batches", 1)
        self._step(step, loss=_scalar(loss), grad_norm=self._grad_norm, lr=self._lr)
        self._grad_norm = None

    def on_fit_end(self, trainer, pl_module):
        self._close()

    def on_exception(self, trainer, pl_module, exception):
        self._close()


def _node_ranks(trainer):
    """This node's ranks of a multi-process Lightning job (trainer.num_devices
    processes a node), or None."""
    try:
        world, rank = int(trainer.world_size), int(trainer.global_rank)
        first, per_node = rank - int(trainer.local_rank), int(trainer.num_devices)
    except (AttributeError, TypeError, ValueError):
        return None
    if world <= 1 or per_node < 1 or first < 0 or first + per_node > world:
        return None
    return list(range(first, first + per_node))


def _grad_norm(module):
    """L2 norm of all gradients as a 0-d tensor on their device, or None."""
    norms = [torch.linalg.vector_norm(p.grad.detach(), 2.0)
             for p in module.parameters() if p.grad is not None]
    if not norms:
        return None
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), 2.0)


def _hf_callback():
    try:
        from transformers import TrainerCallback
    except ImportError as e:
        raise ImportError("foreshock.integrations.ForeshockCallback needs transformers "
                          "(pip install transformers)") from e
    return type("ForeshockCallback", (_TrainerHooks, TrainerCallback),
                {"__doc__": _TrainerHooks.__doc__, "__module__": __name__})


def _lightning_callback():
    try:
        from lightning.pytorch import Callback
    except ImportError:
        try:
            from pytorch_lightning import Callback
        except ImportError as e:
            raise ImportError("foreshock.integrations.ForeshockLightningCallback needs "
                              "lightning (pip install lightning)") from e
    return type("ForeshockLightningCallback", (_LightningHooks, Callback),
                {"__doc__": _LightningHooks.__doc__, "__module__": __name__})


_MAKERS = {"ForeshockCallback": _hf_callback, "ForeshockLightningCallback": _lightning_callback}


def __getattr__(name):
    """The callback classes, built on first use (PEP 562): importing this
    module does not import transformers or lightning."""
    maker = _MAKERS.get(name)
    if maker is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls = maker()
    globals()[name] = cls
    return cls
