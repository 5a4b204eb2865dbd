"""Jobs that hang: the watcher that reads every rank's stack when none makes progress (watcher), and what each
diagnosis of a hang says, read back as data (diagnoses). May import: dslab.messages, dslab.machine."""
