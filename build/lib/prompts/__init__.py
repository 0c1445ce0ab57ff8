"""Jinja prompt texts for the LLM proposer: data, shipped with the package (`prompts/*.j2`)."""
