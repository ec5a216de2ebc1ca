"""lorac.core: what every stage shares, below all of them.

    core < graphs < compiler < runtime

A package imports only from the ones to its left: core imports no other part of lorac,
graphs imports core, the compiler imports core and graphs, the runtime any of them
(tests/test_layers.py enforces it). Importing core runs nothing and sets no environment
variable; it needs only the standard library and numpy.

    errors          LoracError, the one exception for bad user input
    dtypes          compute dtypes and numpy dtypes by name (bfloat16 through ml_dtypes)
    loraplus        the LoRA+ parameter-group rule (PEFT's) and the AdamW settings an
                    optimizer graph bakes in
    constants       names more than one stage spells (targets' listing order, cache folder)
    keys            cache keys: a canonical digest of whole dataclasses plus versions
    integrity, atomic, locks, artifact_cache
                    the artifact directory contract between the compiler (writes) and the
                    runtime (verifies and loads): checksums and seals, atomic replace,
                    file locks, manifest reading and verification
    cuda_kernels    CUDA device code compiled ahead, by source hash, and the TVM load
                    callback that hands it out (the runtime's loader and CUDA tuning)
"""
