"""Host-side statistics of the loss and the gradient norm, each read once per step; pure Python, no torch.

* :mod:`.spike`: :class:`~.spike.SpikeDetector`, a loss far above the robust level of recent healthy losses;
* :mod:`.divergence`: :class:`~.divergence.DivergenceDetector`, a finite loss that keeps growing geometrically;
* :mod:`.gradclip`: :class:`~.gradclip.NormStats`, the gradient norm's moving statistics (ZClip's adaptive
  clipping and the adaptive ``grad_norm`` threshold).

Every rule here is invariant to the loss's sign, offset and positive scale. The guard feeds them the
values of the step's one host read; nothing here reads a tensor.
"""
