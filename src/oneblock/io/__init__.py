"""Reading and writing weights, configs and tokenizers in other libraries' formats."""
