"""One module per op family: each `*_forward` emitter beside its hand-derived `*_backward`
(attention, norm, rope, linear, mlp, loss, conv, scan), the quantized weights' dequantization
(quant.py) and the activation-offload units (offload.py). graphs/decoder.py and the families
compose them into layers."""
