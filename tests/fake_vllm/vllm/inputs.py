def TokensPrompt(prompt_token_ids):  # vLLM's name
    return {"prompt_token_ids": prompt_token_ids}
