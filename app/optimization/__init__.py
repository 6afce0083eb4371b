"""The optimizer and the schedule as the maths of a run: AdamW's parameter groups (or Muon's for the layers' matrices,
muon.py), clipping and the fp32 gradient norm (optimizer.py); the batch arithmetic, the training plan and lr(step)
(schedule.py). Pure functions where they can be, tested without processes.
"""
