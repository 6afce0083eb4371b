"""The Hugging Face model of a run: its config, the layer classes FSDP wraps, building it on every rank and
streaming pretrained weights into its shards (build.py); whether packed examples stay apart in its class and
attention implementation, found by a probe (isolation.py); the loss computed without the full-vocabulary logits
(loss.py). A new model kind enters here.
"""
