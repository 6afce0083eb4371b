"""To and from Hugging Face: a checkpoint converted into a verified model folder (convert.py) and uploaded to the Hub
(upload.py), what a converted folder writes (generate.py), and models, tokenizers and datasets fetched into the cache
before an offline run (prefetch.py).
"""
