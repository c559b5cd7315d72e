"""One peer of tests/test_hf_trainer.py: an ordinary transformers.Trainer script, made collaborative
by swapping the class for CollaborativeTrainer and passing a peer. Prints JSON lines."""

import hashlib
import json
import sys
import time

import torch
from transformers import DataCollatorForLanguageModeling, TrainingArguments

from dedloc import AveragingConfig, Peer, PeerConfig
from dedloc.data.tokenizer import load_tokenizer
from dedloc.recipes import get_recipe
from dedloc.roles.hf_trainer import CollaborativeTrainer


def main(run_id: str, tokenizer_dir: str, out: str, index: int, initial: list[str]) -> None:
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(tokenizer_dir)
    model = get_recipe("tiny-mlm", hidden_size=32, intermediate_size=64, embedding_size=16, layers=1,
                       seq_len=32).build_model(len(tokenizer))
    texts = [f"doc {i} " + " ".join(f"w{(i * 13 + j * 7) % 120}" for j in range(30)) for i in range(400)]
    ids = tokenizer(texts, truncation=True, max_length=32)["input_ids"]
    dataset = [{"input_ids": x} for x in ids[index::2]]
    peer = Peer(PeerConfig(run_id=run_id, initial_peers=tuple(initial), log_level="INFO"),
                AveragingConfig(matchmaking_time=2.0, averaging_timeout=30.0))
    print(json.dumps({"maddrs": peer.maddrs}), flush=True)
    peer.publish_progress(0, 0, 0.0)
    args = TrainingArguments(output_dir=out, max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2,
                             warmup_steps=2, lr_scheduler_type="linear", logging_steps=1, save_steps=2,
                             report_to=[], disable_tqdm=True, use_cpu=True, seed=index, dataloader_num_workers=0)
    deadline = time.monotonic() + 60
    while len(peer.collaboration().peers) < 2 and time.monotonic() < deadline:  # both peers train every step
        time.sleep(0.2)
    trainer = CollaborativeTrainer(peer=peer, target_batch_size=16, model=model, args=args, train_dataset=dataset,
                                   data_collator=DataCollatorForLanguageModeling(tokenizer))
    trainer.train()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    print(json.dumps({"global_step": trainer.state.global_step, "log": trainer.state.log_history,
                      "sha": hashlib.sha256(flat.numpy().tobytes()).hexdigest()}), flush=True)
    trainer.collaborative.offer_state()
    sys.stdin.readline()  # the test says when every peer is done
    trainer.collaborative.close()
    peer.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:])
