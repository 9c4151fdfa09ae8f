"""Online RL (GRPO) of a vision-language model on prompts with images, on the demo's tiny Idefics3 and processor
(recipes/demo/tiny_vlm_grpo_cpu.yaml):

* `type: prompt` rows with images become the processor's own ids (each image expanded into its tokens) and
  carry the images' bytes; a text model's prompt with images is an error;
* the rollout gives the backend each prompt's images, and each packed micro-batch the pixels of its sequences'
  prompts in order, image tokens never trained;
* the log-probs of a packed micro-batch (the policy's in the loss, the sampling policy's and the reference's)
  equal those of the padded layout, one sequence per row with its own pixels (TRL's layout), and change with
  the picture;
* the loss and gradients of a packed micro-batch with pixels equal TRL's GRPOTrainer on the padded layout with
  the same pictures (its own VLM path);
* generation never writes image markup; a family whose positions come from the images is refused.
"""

from __future__ import annotations

import copy
import io
import json
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch
import yaml
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor, Idefics3Config

from finetune.constants import IGNORE_INDEX
from finetune.data.formats.encode import image_token_ids
from finetune.data.formats.tokenize import tokenize_dataset
from finetune.errors import FinetuneError
from finetune.generation.protocol import Completion
from finetune.generation.rewards import Reward
from finetune.losses import policy_gradient as pg
from finetune.losses.preference import token_logps
from finetune.objectives.online import OnlineObjective, _check_packable
from finetune.objectives.rollout import RolloutBuffer, add_pixels, pack_completions, token_logps_at
from finetune.recipe import dataset_entry, validate_recipe
from finetune.recipe.grpo import GrpoSection

REPO = Path(__file__).resolve().parents[3]
RECIPE = REPO / "recipes" / "demo" / "tiny_vlm_grpo_cpu.yaml"
COLOURS = {"red": (220, 30, 30), "blue": (30, 60, 220), "green": (30, 170, 40)}
QUESTION = "What colour is the shape?"


@pytest.fixture(scope="module")
def processor():
    return AutoProcessor.from_pretrained(REPO / "recipes" / "demo" / "vlm_processor")


def tiny_vlm(seed: int = 0) -> torch.nn.Module:
    """The demo recipe's random-init Idefics3."""
    config = yaml.safe_load(RECIPE.read_text())["model"]["config_path"]
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(
        Idefics3Config(**{k: v for k, v in config.items() if k != "model_type"})
    )
    return model.eval()


def png(colour) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def prompt_rows(tmp_path: Path, processor, colours=("red", "blue", "green")) -> list[dict]:
    """Prepared prompt rows (as prepare writes them) of the colour question about one picture each: image parts
    for the first, LLaVA style (an <image> placeholder and an images column) for the others."""
    (tmp_path / "images").mkdir(exist_ok=True)
    prompts, images = [], []
    for k, colour in enumerate(colours):
        (tmp_path / "images" / f"{colour}.png").write_bytes(png(COLOURS[colour]))
        if k == 0:
            parts = [{"type": "image", "image": f"images/{colour}.png"}, {"type": "text", "text": QUESTION}]
            prompts.append(json.dumps([{"role": "user", "content": parts}]))
            images.append(None)
        else:
            prompts.append(json.dumps(f"<image>{QUESTION}"))
            images.append([f"images/{colour}.png"])
    (tmp_path / "prompts.jsonl").write_text(
        "".join(
            json.dumps({"prompt": json.loads(p), "images": i, "colour": c}) + "\n"
            for p, i, c in zip(prompts, images, colours, strict=True)
        )
    )
    ds = datasets.load_dataset("json", data_files=str(tmp_path / "prompts.jsonl"), split="train")
    result = tokenize_dataset(
        ds, dataset_entry(path=str(tmp_path / "prompts.jsonl"), type="prompt"), processor.tokenizer,
        sequence_len=256, excess_length_strategy="raise", on_bad_row="raise", processor=processor,
    )  # fmt: skip
    return [{**row, "row_index": k} for k, row in enumerate(result.dataset)]


def test_prompt_rows_with_images_are_the_processors_ids_and_carry_the_images(tmp_path, processor):
    """Both shapes of a prompt with an image give the ids of the processor's own chat rendering (each image
    expanded into its 4 tokens for the demo model), no trained label, and the image's bytes."""
    rows = prompt_rows(tmp_path, processor)
    prefix = processor.tokenizer("a")["input_ids"][:-1]  # what training puts first (bos)
    for row, colour in zip(rows, ("red", "blue", "green"), strict=True):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        image = Image.open(io.BytesIO(png(COLOURS[colour]))).convert("RGB")
        expected = processor(text=[text], images=[[image]], add_special_tokens=False)["input_ids"][0]
        assert row["input_ids"] == [*prefix, *expected]
        assert (
            sum(t in image_token_ids(processor) for t in row["input_ids"]) > 4
        )  # the markup and 4 image tokens
        assert row["input_ids"].count(processor.image_token_id) == 4
        assert set(row["labels"]) == {IGNORE_INDEX}
        assert row["images"] == [(tmp_path / "images" / f"{colour}.png").read_bytes()]
        assert json.loads(row["row"])["colour"] == colour  # the reward's column


def test_a_text_models_prompt_with_images_is_an_error(tmp_path, processor):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "red.png").write_bytes(png(COLOURS["red"]))
    parts = [{"type": "image", "image": "images/red.png"}, {"type": "text", "text": QUESTION}]
    ds = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": parts}]}])
    with pytest.raises(FinetuneError, match=r"model reads only text.*model\.kind: vlm"):
        tokenize_dataset(
            ds, dataset_entry(path=str(tmp_path / "p.jsonl"), type="prompt"), processor.tokenizer,
            sequence_len=256, excess_length_strategy="raise", on_bad_row="skip",
        )  # fmt: skip


class RecordingBackend:
    """A generation backend answering every prompt with fixed completions, recording the images it was given."""

    name = "recording"
    copies_weights = False
    stops = (2,)

    def __init__(self, processor, completions):
        self.processor, self.tokenizer, self.completions = processor, processor.tokenizer, completions
        self.images = []

    def generate(self, prompts, params, *, seeds=None, batch_size=8, images=None, progress=False):
        self.images.append(images)
        return [[Completion(list(ids), True) for ids in self.completions] for _ in prompts]


class FakeReference:
    """The reference the rollout asks for its log-probs (the LoRA base, or a copy, in a real run)."""

    forward_passes = 1

    def __init__(self, model):
        self.reference = model

    @contextmanager
    def model(self, policy, accelerator):
        yield self.reference


def online_objective(processor, completions, reference, **settings) -> OnlineObjective:
    """An online objective of a vision-language model ready to roll out through a RecordingBackend."""
    obj = OnlineObjective.__new__(OnlineObjective)
    obj.ahead, obj.toolbox, obj.message_fields, obj.sharding = None, None, [], None
    settings = {"loss_type": "grpo", **settings}
    obj.settings = GrpoSection(
        max_new_tokens=4, rewards=[{"name": "length"}], num_generations=2, log_completions=0, **settings
    )
    obj.estimator = pg.ESTIMATORS["group"]
    obj.train = SimpleNamespace(seed=5, micro_batch_size=4)  # two prompts' completions per packed row
    obj.data = SimpleNamespace(pad_to_multiple_of=8)
    obj.processor, obj.tokenizer = processor, processor.tokenizer
    obj.buffer = RolloutBuffer()
    obj.accelerator = SimpleNamespace(num_processes=1, device=torch.device("cpu"), unwrap_model=lambda m: m)
    obj.backend = RecordingBackend(processor, completions)
    obj.reference = FakeReference(reference)

    def named(texts, rows):
        return [float(text.strip() == row["colour"]) for text, row in zip(texts, rows, strict=True)]

    obj.rewards = [Reward("colour", 1.0, named)]
    return obj


def words(processor, *texts: str) -> list[list[int]]:
    return [[*processor.tokenizer(f" {t}", add_special_tokens=False)["input_ids"], 2] for t in texts]


def padded_logps(model, seqs, pictures, processor, temperature=1.0) -> torch.Tensor:
    """Each completion token's log-prob from a right-padded batch, one sequence a row with its own picture
    (TRL's layout: attention mask, pixels per row), in sequence order."""
    width = max(len(p) + len(c) for p, c in seqs)
    ids = torch.full((len(seqs), width), 3)
    labels = torch.full((len(seqs), width), IGNORE_INDEX)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for k, (p, c) in enumerate(seqs):
        ids[k, : len(p) + len(c)] = torch.tensor(p + c)
        labels[k, len(p) : len(p) + len(c)] = torch.tensor(c)
        mask[k, : len(p) + len(c)] = 1
    pixels = processor.image_processor(images=[[pic] for pic in pictures], return_tensors="pt")
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, **pixels).logits / temperature
    return token_logps(logits, labels)[labels != IGNORE_INDEX]


def test_the_rollout_brings_each_prompts_images_to_the_backend_and_its_pixels_to_the_packed_rows(
    tmp_path, processor
):
    """Through the rollout seam: the backend gets each prompt's images; each packed micro-batch (2 prompts x 2
    completions) holds its 4 sequences' pixels in order (each prompt's picture as the image processor makes it),
    as many images as its image tokens say; image tokens are never trained (label -100, no completion, no
    advantage); the sampling policy's and the reference's log-probs of the packed rows are the padded layout's."""
    rows = prompt_rows(tmp_path, processor, ("red", "blue", "green", "red"))
    policy, reference = tiny_vlm(0), tiny_vlm(1)
    obj = online_objective(processor, words(processor, "red", "blue"), reference, beta=0.1, num_iterations=2)
    batches, stats = obj.rollout(policy, [rows], step=1)
    assert obj.backend.images == [[row["images"] for row in rows]]
    assert (
        stats["completions"] == 8 and stats["reward_sum"] == 3.0
    )  # red, blue, red named once each (green never)
    per_prompt = [Image.open(io.BytesIO(row["images"][0])).convert("RGB") for row in rows]
    assert len(batches) == 2
    for b, batch in enumerate(batches):
        pictures = [per_prompt[2 * b + k // 2] for k in range(4)]  # sequence k answers prompt 2b + k // 2
        expected = processor.image_processor(images=[pictures], return_tensors="pt")
        torch.testing.assert_close(batch["pixel_values"], expected["pixel_values"])
        torch.testing.assert_close(batch["pixel_attention_mask"], expected["pixel_attention_mask"])
        image_tokens = batch["input_ids"] == processor.image_token_id
        assert int(image_tokens.sum()) == 4 * batch["pixel_values"].shape[1] == 16
        markup = torch.isin(batch["input_ids"], torch.tensor(sorted(image_token_ids(processor))))
        assert (batch["labels"][markup] == IGNORE_INDEX).all() and (batch["seq_index"][markup] == -1).all()
        assert (batch["advantages"][markup] == 0).all()
        seqs = [(list(rows[2 * b + k // 2]["input_ids"]), obj.backend.completions[k % 2]) for k in range(4)]
        trained = batch["labels"] != IGNORE_INDEX
        for key, model in (("old_logps", policy), ("ref_logps", reference)):
            torch.testing.assert_close(
                batch[key][trained], padded_logps(model, seqs, pictures, processor), rtol=1e-4, atol=1e-5
            )


def test_the_loss_of_a_packed_rollout_with_pixels_is_the_padded_layouts(tmp_path, processor):
    """The policy's pass: the objective's loss on a packed micro-batch with its pixels equals the per-token
    loss of the padded layout's log-probs (each sequence a row with its own picture), and its gradients reach
    the vision tower; with the pictures swapped between the sequences the log-probs change (the model reads
    them)."""
    rows = prompt_rows(tmp_path, processor, ("red", "blue"))
    policy = tiny_vlm(0).train()
    completions = words(processor, "red", "green")
    seqs = [(list(rows[k // 2]["input_ids"]), completions[k % 2]) for k in range(4)]
    advantages = [0.9, -0.9, 0.4, -0.4]
    (batch,) = pack_completions(
        [(p, c, True, a) for (p, c), a in zip(seqs, advantages, strict=True)], per_batch=4, pad_token_id=3,
        pad_to_multiple_of=8,
    )  # fmt: skip
    add_pixels([batch], [rows[k // 2]["images"] for k in range(4)], processor)
    obj = online_objective(processor, completions, None, temperature=0.7)
    loss, _ = obj.loss(policy, batch, obj.units(batch))
    loss.backward()
    pictures = [Image.open(io.BytesIO(rows[k // 2]["images"][0])).convert("RGB") for k in range(4)]
    logps = padded_logps(policy, seqs, pictures, processor, temperature=0.7)
    owners = torch.tensor([k for k, (_, c) in enumerate(seqs) for _ in c])
    out = pg.per_token_loss(
        logps, logps.detach(), torch.tensor(advantages)[owners], epsilon_low=0.2, epsilon_high=0.2
    )
    expected = pg.policy_loss_sums(out.losses, owners, 4, loss_type="grpo", max_completion_length=4) / 4
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)
    tower = policy.model.vision_model.embeddings.patch_embedding.weight.grad
    assert tower is not None and tower.abs().sum() > 0
    swapped = add_pixels_swapped(batch, rows, processor)
    with torch.no_grad():
        trained = batch["labels"] != IGNORE_INDEX
        assert not torch.allclose(
            token_logps_at(policy, batch)[trained], token_logps_at(policy, swapped)[trained]
        )


def add_pixels_swapped(batch: dict, rows: list[dict], processor) -> dict:
    """The micro-batch with the two prompts' pictures swapped."""
    swapped = {k: v for k, v in batch.items() if not k.startswith("pixel")}
    add_pixels([swapped], [rows[1 - k // 2]["images"] for k in range(4)], processor)
    return swapped


def test_generation_never_writes_image_markup(processor):
    """A model that would write the <image> token (its logit raised) does not when it generates with its
    processor (a completion would then hold one more image token than its prompt has pictures for)."""
    from finetune.generation.transformers_backend import generate_ids

    model = tiny_vlm(0)
    with torch.no_grad():
        model.lm_head.weight[processor.image_token_id] = 5.0 * model.model.text_model.norm.weight.sign()
    rows = [[1, *processor.tokenizer(" hi", add_special_tokens=False)["input_ids"]]]
    free = generate_ids(model, processor.tokenizer, rows, max_new_tokens=4)[0][0].ids
    assert processor.image_token_id in free  # the test's model does want the token
    kept = generate_ids(model, processor.tokenizer, rows, max_new_tokens=4, processor=processor)[0][0].ids
    assert not set(kept) & image_token_ids(processor), kept


def test_what_online_rl_of_a_vision_language_model_does_not_do_yet_is_an_error():
    from pydantic import ValidationError

    from tests.vlm_configs import qwen2_vl

    for change, field, reason in (
        ({"generation_backend": "vllm"}, "generation_backend", "transformers backend for now"),
        ({"tools": [{"function": "rewards.py:colour_named"}]}, "tools", "text models for now"),
    ):
        recipe = yaml.safe_load(RECIPE.read_text())
        recipe["grpo"] |= change
        with pytest.raises(ValidationError, match=reason) as caught:
            validate_recipe(recipe)
        assert field in str(caught.value)
    with pytest.raises(FinetuneError, match="multimodal RoPE"):
        _check_packable(SimpleNamespace(config=qwen2_vl()))
    _check_packable(tiny_vlm(0))  # Idefics3 packs


def test_a_packed_rollout_with_pixels_gives_trls_vlm_grpo_loss_and_gradients(tmp_path, processor):
    """The objective's loss on a packed micro-batch with its pixels against TRL's GRPOTrainer._compute_loss on
    the padded layout of the same completions with the same pictures (its own VLM path: pixel_values and
    pixel_attention_mask per row, num_images), as the text loss is compared in test_online_objective.py: loss and
    gradients, with a temperature, for the demo's loss type (the loss types themselves are compared on text:
    the pixels change the log-probs, not the loss's arithmetic)."""
    loss_type = "dapo"
    trl = pytest.importorskip("trl", reason="trl is not installed (it is in the test extra)")

    rows = prompt_rows(tmp_path, processor, ("red", "blue"))
    completions = [words(processor, "red")[0], words(processor, "green blue")[0]]
    seqs = [(list(rows[k // 2]["input_ids"]), completions[k % 2]) for k in range(4)]
    advantages = torch.tensor([0.9, -0.9, 0.4, -0.4])
    width = max(len(c) for _, c in seqs)
    policy = tiny_vlm(0).train()
    ours_model = copy.deepcopy(policy)

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, seed=0, bf16=False, num_generations=2,
        per_device_train_batch_size=4, max_completion_length=width, loss_type=loss_type, temperature=0.7,
    )  # fmt: skip
    trainer = trl.GRPOTrainer(
        model=policy, reward_funcs=lambda completions, **kwargs: [0.0] * len(completions), args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": ["a", "b"]}), processing_class=processor,
    )  # fmt: skip
    trainer.current_gradient_accumulation_steps = 1
    pictures = [Image.open(io.BytesIO(rows[k // 2]["images"][0])).convert("RGB") for k in range(4)]
    pixels = processor.image_processor(images=[[pic] for pic in pictures], return_tensors="pt")
    completion_ids = torch.full((4, width), 3)
    completion_mask = torch.zeros(4, width, dtype=torch.long)
    for k, (_, c) in enumerate(seqs):
        completion_ids[k, : len(c)], completion_mask[k, : len(c)] = torch.tensor(c), 1
    prompt_ids = torch.tensor([p for p, _ in seqs])  # one length: the same question about one picture each
    inputs = {
        "prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids), "completion_ids": completion_ids,
        "completion_mask": completion_mask, "advantages": advantages, "num_images": [1] * 4,
        "pixel_values": pixels["pixel_values"], "pixel_attention_mask": pixels["pixel_attention_mask"],
        "num_items_in_batch": completion_mask.sum(),
    }  # fmt: skip
    trl_loss = trainer._compute_loss(trainer.model, inputs)
    trl_loss.backward()

    (batch,) = pack_completions(
        [(p, c, True, float(a)) for (p, c), a in zip(seqs, advantages, strict=True)], per_batch=4, pad_token_id=3,
        pad_to_multiple_of=8,
    )  # fmt: skip
    add_pixels([batch], [rows[k // 2]["images"] for k in range(4)], processor)
    obj = online_objective(processor, completions, None, temperature=0.7, loss_type=loss_type)
    loss, _ = obj.loss(ours_model, batch, obj.units(batch))
    loss.backward()
    torch.testing.assert_close(loss, trl_loss.detach(), rtol=1e-5, atol=1e-6)
    theirs = {n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None}
    ours = {n: p.grad for n, p in ours_model.named_parameters() if p.grad is not None}
    assert ours.keys() == theirs.keys() and any("vision_model" in n for n in ours)
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-4, atol=1e-6, msg=name)
