"""megatron-core backend pieces: CPU compat patches, HF-equivalent GPTModel, weight conversion,
vocab-parallel log-probs/entropy.

Importing this package imports neither torch.distributed state nor megatron-core; the submodules
import megatron lazily inside their functions, so ``rlaudit`` works without the megatron extra.

    compat          apply_cpu_patches, init_megatron, teardown_megatron, APPLIED
    model           hf_model_spec, gpt_config_from_hf, build_gpt_model, attention_mask_4d,
                    position_ids, padded_vocab_size, pipeline_forward
    convert         hf_to_megatron, megatron_to_hf, load_hf_weights, gather_hf_state_dict,
                    load_hf_checkpoint
    vocab_parallel  vocab_parallel_logprobs_entropy, vocab_parallel_log_probs_at
"""
