

def test_checkpoint_resume_equals_the_uninterrupted_run(tiny_model, single, tmp_path):
    """verl's save_checkpoint after 2 calls, a fresh group's load_checkpoint, the third call: as the run of
    3 calls without a pause."""
    config = trainer_config(tiny_model)
    folder = str(tmp_path / "global_step_2" / "critic")
    run_calls(config, world_size=1, calls=2, save_to=folder)
    with critic_group(config, world_size=1) as critic_wg:
        critic_wg.load_checkpoint(folder, None, False)
        batch = verl_batch(seed=2)
        values = v0_compute_values(critic_wg, batch)
        batch.batch["values"] = values
        metrics = v0_update_critic(critic_wg, batch, config)
        after = v0_compute_values(critic_wg, verl_batch(seed=CALLS))
    ref_calls, ref_after = single
    assert torch.equal(values, ref_calls[2][0])
    assert metrics["critic/vf_loss"] == ref_calls[2][1]["critic/vf_loss"]
    assert torch.equal(after, ref_after)


def test_malformed_batch_names_the_key_and_changes_nothing(tiny_model, ray_cluster):
    config = trainer_config(tiny_model)
    with critic_group(config, world_size=2) as critic_wg:
        batch = verl_batch(seed=0)
        before = v0_compute_values(critic_wg, batch)
        batch.batch["values"] = before
        broken = DataProto.from_dict(tensors={k: v for k, v in batch.batch.items() if k != "returns"},
                                     non_tensors=dict(batch.non_tensor_batch))
        with pytest.raises(ray.exceptions.RayTaskError, match=r"missing key\(s\) \['returns'\]"):
            v0_update_critic(critic_wg, broken, config)
        assert torch.equal(v0_compute_values(critic_wg, batch), before)
