"""index_out_of_range."""

from __future__ import annotations

import torch
import torch.nn as nn

import buggy_models as bm
from scenario_kit import _cell, _in_file, _ns


def _setup_matrix_factorization():
    torch.manual_seed(0)
    n_users, n_items = 50, 40
    users = torch.randint(1, n_users + 1, (64,))  # ids are 1-based in the ratings file
    users[0] = n_users  # make sure the last user is in this batch
    user_emb, item_emb = nn.Embedding(n_users, 8), nn.Embedding(n_items, 8)
    params = list(user_emb.parameters()) + list(item_emb.parameters())
    return _ns(
        users=users,
        items=torch.randint(0, n_items, (64,)),
        ratings=torch.rand(64) * 5,
        user_emb=user_emb,
        item_emb=item_emb,
        optimizer=torch.optim.Adam(params, lr=1e-2),
    )


def _setup_tiny_lm_with_eos():
    torch.manual_seed(0)
    vocab_size = 32
    tokens = torch.randint(0, vocab_size, (4, 13))
    eos_id = vocab_size  # the tokenizer's "<eos>" was added after the embedding was sized
    tokens[:, 6] = eos_id  # packed sequences: two documents per row, separated by <eos>
    model = bm.TinyLM(vocab_size, 16)
    return _ns(
        tokens=tokens,
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_one_based_labels():
    torch.manual_seed(0)
    labels = torch.randint(1, 11, (32,))  # 1..10 straight from the CSV
    labels[3] = 10
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 10))
    return _ns(
        x=torch.randn(32, 20),
        y=labels,
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_semi_supervised():
    torch.manual_seed(0)
    y = torch.randint(0, 5, (32,))
    y[::4] = -1  # unlabeled examples marked with -1
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))
    return _ns(
        x=torch.randn(32, 20),
        y=y,
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_dqn():
    torch.manual_seed(0)
    n_actions = 4  # the q-network was built for 4 actions ...
    q_net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, n_actions))
    target_net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, n_actions))
    target_net.load_state_dict(q_net.state_dict())
    actions = torch.randint(0, 5, (32,))  # ... but the env's action space has 5
    actions[0] = 4
    return _ns(
        states=torch.randn(32, 8),
        actions=actions,
        rewards=torch.randn(32),
        next_states=torch.randn(32, 8),
        dones=torch.zeros(32),
        gamma=0.99,
        q_net=q_net,
        target_net=target_net,
        optimizer=torch.optim.Adam(q_net.parameters(), lr=1e-3),
    )


def _setup_label_smoothing():
    torch.manual_seed(0)
    y = torch.randint(0, 6, (32,))  # a 6th class was added to the data, not to the model
    y[0] = 5
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))
    return _ns(
        x=torch.randn(32, 20),
        y=y,
        model=model,
        criterion=bm.LabelSmoothingLoss(0.1),
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


INDEX = [
    _cell(
        "embedding_user_ids_one_based",
        "index_out_of_range",
        """\
        optimizer.zero_grad()
        u = user_emb(users)  # <-- root cause
        v = item_emb(items)
        pred = (u * v).sum(-1)
        loss = F.mse_loss(pred, ratings)
        loss.backward()
        optimizer.step()
        """,
        _setup_matrix_factorization,
        module="user_emb",
        raises=(IndexError, "index out of range in self"),
        doc="matrix factorisation with 1-based user ids: id == num_embeddings.",
    ),
    _in_file(
        "embedding_eos_token_id_equals_vocab_size",
        "index_out_of_range",
        """\
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        """,
        _setup_tiny_lm_with_eos,
        module="model.tok_emb",
        bug="token_embedding",
        raises=(IndexError, "index out of range in self"),
        doc="an <eos> separator id added to the tokenizer is one past the embedding table.",
    ),
    _cell(
        "cross_entropy_target_one_based",
        "index_out_of_range",
        """\
        optimizer.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits, y)  # <-- root cause
        loss.backward()
        optimizer.step()
        """,
        _setup_one_based_labels,
        module=None,
        raises=(IndexError, "Target 10 is out of bounds"),
        doc="labels 1..10 for 10 classes.",
    ),
    _cell(
        "cross_entropy_negative_target_for_unlabeled",
        "index_out_of_range",
        """\
        optimizer.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits, y)  # <-- root cause
        loss.backward()
        optimizer.step()
        """,
        _setup_semi_supervised,
        module=None,
        raises=(IndexError, "Target -1 is out of bounds"),
        doc="unlabeled rows marked -1 but cross_entropy's ignore_index is -100.",
    ),
    _cell(
        "dqn_gather_action_out_of_range",
        "index_out_of_range",
        """\
        optimizer.zero_grad()
        with torch.no_grad():
            target = rewards + gamma * (1 - dones) * target_net(next_states).max(1).values
        q_sa = q_net(states).gather(1, actions[:, None]).squeeze(1)  # <-- root cause
        loss = F.smooth_l1_loss(q_sa, target)
        loss.backward()
        optimizer.step()
        """,
        _setup_dqn,
        module=None,
        op="aten::gather",
        raises=(RuntimeError, "index 4 is out of bounds for dimension 1 with size 4"),
        doc="DQN update; the replay buffer holds actions of a 5-action env, the net has 4 outputs.",
    ),
    _in_file(
        "label_smoothing_loss_gather_out_of_range",
        "index_out_of_range",
        """\
        optimizer.zero_grad()
        logits = model(x)
        loss = criterion(logits, y)
        loss.backward()
        optimizer.step()
        """,
        _setup_label_smoothing,
        module="criterion",
        op="aten::gather",
        bug="label_gather",
        raises=(RuntimeError, "index 5 is out of bounds for dimension 1 with size 5"),
        doc="custom label-smoothing loss (an nn.Module) gathers a class id the model lacks.",
    ),
]
