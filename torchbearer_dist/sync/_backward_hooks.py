"""How :class:`~torchbearer_dist.sync.buckets.GradientBuckets` notices a backward pass: its hooks, start and end.

Two ways to notice backward and fill the buckets:

- *Overlapped*: a post-accumulate-grad hook on each parameter copies its gradient in; once every
  gradient of a bucket is in, the bucket's all-reduce starts while backward computes the rest.
- *After backward*: one tensor hook on the model's output (the place of DDP's ``_DDPSink``) queues
  the end-of-backward callback, which copies every gradient into its bucket (one ``copy_`` per
  parameter, no hook per parameter). Parameters outside the model (learnable loss terms) get a post-accumulate hook.
  ``overlap='auto'`` (the default) overlaps only when the parameters span more than one bucket.

The hooks act only while *armed* (between the start of a training step and its end), so a backward
outside a Trial's training step never starts a collective. The first hook of a pass decides whether it
synchronizes (every ``sync_every``-th armed pass) and queues its end, which reduces the buckets.
"""
import torch

from torchbearer_dist.sync._autograd import queue_at_backward_end


def _output_tensors(output):
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _output_tensors(item)]
    return []


class BackwardHooks:
    """The hooks of :class:`~torchbearer_dist.sync.buckets.GradientBuckets` (a mixin, on its attributes): they
    notice each armed backward pass, copy gradients into their buckets (with overlap) and end it with ``reduce()``."""

    def attach(self, module=None):
        """Register the hooks that notice backward: per parameter with overlap, else on the modules' outputs.

        Args:
            module (torch.nn.Module or list): the module, or modules, whose outputs backward passes
                start from (a GAN's generator and discriminator); a parameter outside them gets a
                hook of its own, so every backward that reaches a parameter is noticed
        """
        if self._hooks:
            return
        if self.overlap:
            for bucket in self.buckets:
                for position, p in enumerate(bucket.params):
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._overlap_hook(bucket, position)))
            return
        modules = [] if module is None else [module] if isinstance(module, torch.nn.Module) else list(module)
        inside = {id(p) for m in modules for p in m.parameters()}
        for m in modules:
            self._hooks.append(m.register_forward_hook(self._on_forward))
        for p in self.params:
            if id(p) not in inside:  # reached without the model's output, e.g. a learnable loss term
                self._hooks.append(p.register_post_accumulate_grad_hook(self._notice))

    def detach(self):
        """Remove every hook; backward passes then stay local."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.disarm()

    def _on_forward(self, module, inputs, output):
        if self._armed and torch.is_grad_enabled():
            for tensor in _output_tensors(output):
                tensor.register_hook(self._notice)

    def _notice(self, *_):
        if self._armed and not self._in_backward:
            self._begin()

    def _begin(self):
        """The first hook of a backward pass: decide whether it synchronizes, queue its end."""
        self._in_backward = True
        self.began += 1
        self.backwards += 1
        # A second backward in the step (a GAN's discriminator pass) synchronizes again: the gradients
        # averaged before are equal on every rank, so averaging them again leaves them as they are.
        self._syncing = self.backwards % self.sync_every == 0
        end = self._end_sync if self._syncing else self._end_local
        if not queue_at_backward_end(end):
            self._pending_end = end  # run by end_backward(), from the Trial's on_backward

    def end_backward(self):
        """End a backward pass whose end torch could not queue (see :mod:`~torchbearer_dist.sync._autograd`).

        Does nothing when the pass already ended, as it does whenever torch queues the end itself.
        """
        end, self._pending_end = self._pending_end, None
        if end is not None:
            end()

    def _end_local(self):
        self._in_backward = False

    def _end_sync(self):
        self._in_backward = False
        self.synced = True
        self.reduce()

    def _overlap_hook(self, bucket, position):
        view = bucket.views[position]

        def on_grad(param):
            if not self._in_backward:
                if not self._armed:
                    return
                self._begin()
            if not self._syncing:
                return
            if bucket.sent:
                raise RuntimeError('a gradient was produced again after its bucket was sent in this backward pass')
            grad = param.grad
            if grad is not view:
                if grad.is_sparse:
                    bucket.put(position, grad)
                else:
                    view.copy_(grad)
                    param.grad = view
            if not bucket.present[position]:
                if self._ready is not None:
                    self._ready.append(param)
                bucket.present[position] = True
                bucket.pending -= 1
                if bucket.pending == 0:
                    self._start_ready()
        return on_grad

    def _start_ready(self):
        buckets = self.buckets
        while self._next < len(buckets) and buckets[self._next].pending == 0:
            self._start(buckets[self._next])
            self._next += 1

    def missed(self):
        """Whether this step computed gradients that no hook noticed, so they were never averaged."""
        return self._armed and not self.began and any(p.grad is not None for p in self.params)
