"""Model families (Llama, Mistral, Qwen2, Qwen3), their config, and checkpoint loading."""
