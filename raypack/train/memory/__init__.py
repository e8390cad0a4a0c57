"""What a training rank holds in memory, estimated before anything is built: the estimate that
sizes a run (`raypack plan`, cluster/memory.py) and picks `model.gradient_checkpointing: auto`.

    estimate.py   the per-GPU estimate: weights, gradients, optimizer state, activations, budget
    auto.py       model.gradient_checkpointing: auto, the fastest mode whose estimate fits the device
    engines.py    what each engine keeps of the weights, gradients and optimizer state
    mixers.py     what a hybrid's recurrent and convolutional mixers keep for backward
    vision.py     a VLM's vision tower: its parameters, what it keeps per patch, its cost
"""
