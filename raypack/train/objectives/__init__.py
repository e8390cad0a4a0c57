"""What an optimizer step minimizes (raypack/train/step.py runs either objective):

    loss.py           SFT: Σ token cross-entropy from the final hidden states, a chunk at a time
    chunked_ce.py     the chunked cross-entropy, and each sequence's log-prob sum for DPO
    dpo.py            DPO: each pair's loss from its two sequences' sums, the mean over the step's pairs
    dpo_reference.py  DPO's reference sums: one pass before training, or LoRA's base in the step
    router_loss.py    an MoE model's load-balancing loss, riding either objective
    expert_load.py    the experts' load it measures, for the reports
"""
