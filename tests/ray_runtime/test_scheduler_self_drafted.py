"""PP=1 async speculative decoding at the scheduler level: the real Scheduler (placeholders on,
k = 3, two plans in flight) against a real InputBatch acting as the single rank, which runs
self-drafted steps with its own drafts the way StageRunner.prepare_inputs does; a greedy
"model" with known true tokens, EOS inside accepted drafts, tight budgets, small pools and
max_model_len. Every step is audited (self-drafted digests only once corrected), every KV
write (the target's, and the draft model's lookahead) must fall inside the row's blocks,
and the outputs must be the true tokens."""
from collections import deque

import numpy as np
import pytest

from ray_runtime.messages import SamplerOutput
from ray_runtime.reconcile import audit
from ray_runtime.request import Request
from ray_runtime.sampling_params import SamplingParams
from ray_runtime.scheduler import Scheduler
from stages.input_batch import InputBatch

K = 3
EOS = 2


def truth(r,i,eos_at):
    if i==eos_at.get(r): return EOS
    return 100 + (sum(map(ord,r))*7 + i*13) % 50
def run(seed, budget=64, nblocks=512, mml=256, bs=2, nreq=6, eos=True, maxseqs=4):
    rng=np.random.default_rng(seed)
    s=Scheduler(max_num_seqs=maxseqs,max_num_batched_tokens=budget,num_kv_blocks=nblocks,block_size=bs,
                max_model_len=mml,allow_placeholders=True,num_speculative_tokens=K)
    reqs={}; eos_at={}
    for i in range(nreq):
        n=int(rng.integers(3,20)); r=f"r{i}"
        mt=int(rng.integers(5,30))
        reqs[r]=Request(r,rng.integers(3,1000,n).tolist(),SamplingParams(max_tokens=mt,temperature=0.0),frozenset({EOS}),i)
        if eos and rng.random()<0.5: eos_at[r]=int(rng.integers(1,mt))
        s.add_request(reqs[r])
    b=InputBatch(maxseqs,mml,bs)
    infl=deque(); nmis=0; selfd=0
    def execute(rec):
        nonlocal selfd
        plan=rec.plan
        b.apply_plan(plan); b.check()
        view={n.req_id:(n.num_computed_tokens,len(n.token_ids),0) for n in plan.new_reqs}
        view.update({d.req_id:(d.num_computed_tokens,d.token_start+len(d.new_token_ids),len(d.draft_token_ids)) for d in plan.cached_reqs})
        num_new=list(plan.num_scheduled_tokens)
        for d in plan.cached_reqs:
            if d.self_drafted:
                selfd+=1
                row=b.req_id_to_slot[d.req_id]; nd=int(b.num_draft_tokens[row]); i=plan.scheduled_req_ids.index(d.req_id)
                assert 1+nd<=num_new[i]; num_new[i]=1+nd
                view[d.req_id]=(int(b.num_computed_tokens[row]),int(b.num_tokens_known[row]),nd)
        dig=b.digests(plan)
        samp=[]
        for r,n in zip(plan.scheduled_req_ids,num_new):
            st,dk,nd=view[r]; row=b.req_id_to_slot[r]; end=st+n
            assert end<=b.num_blocks[row]*bs, ("KV past blocks", r, end, b.num_blocks[row])
            if end>=dk: samp.append(r)
        for r,n in zip(plan.scheduled_req_ids,num_new): b.mark_computed(r,n)
        ids=[];incs=[];toks=[];nds=[];props=[]
        for r in samp:
            row=b.req_id_to_slot[r]; drafts=b.drafts(r)
            o=int(b.num_tokens_known[row]-b.num_prompt_tokens[row])
            acc=0
            while acc<len(drafts) and drafts[acc]==truth(r,o+acc,eos_at): acc+=1
            em=drafts[:acc]+[truth(r,o+acc,eos_at)]
            b.append_tokens(r,em); b.resolve_drafts(r,acc)
            known=int(b.num_tokens_known[row]); nxt=o+len(em)
            cap=max(0,min(K,b.sampling[row].max_tokens-nxt-1,mml-1-known))
            # draft model KV writes up to known+cap-2
            if cap>=2: assert known+cap-2 < b.num_blocks[row]*bs, ("draft KV past blocks", r)
            prop=[truth(r,nxt+j,eos_at) if rng.random()<0.6 else 999 for j in range(cap)]
            b.set_drafts(r,prop)
            ids.append(r);incs.append(int(b.incarnation[row]));toks.append(em);nds.append(len(drafts));props.append(prop)
        b.check()
        return dig, SamplerOutput(step_id=plan.step_id,req_ids=ids,incarnations=incs,sampled_token_ids=toks,num_draft_tokens=nds,draft_token_ids=props)
    for it in range(5000):
        if not (s.has_unfinished() or infl): break
        while len(infl)<2:
            rec=s.schedule()
            if rec is None: break
            infl.append((rec,execute(rec)))
        rec,(dig,out)=infl.popleft()
        ms=audit(rec.expected,dig,0,True,rec.self_drafted)
        bad=set(m.req_id for m in ms); nmis+=len(ms)
        s.update_from_output(rec,out,frozenset(bad))
        for r in bad: s.preempt(r)
        s.check(); s.blocks.check()
        s.pop_finished()
    for r,req in reqs.items():
        want=[truth(r,i,eos_at) for i in range(req.num_output_tokens)]
        assert req.output_token_ids==want,(r,req.output_token_ids,want)
    return nmis, selfd, s.spec_num_draft_tokens, s.spec_num_accepted_tokens, s.num_preemptions


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kw", [{}, {"budget": 6, "nblocks": 30}, {"mml": 20},
                                {"budget": 5, "nblocks": 24, "mml": 24}],
                         ids=["roomy", "tight-budget-small-pool", "short-context", "all-tight"])
def test_self_drafted_steps_are_corrected_and_audited(seed, kw):
    mismatches, self_drafted, drafted, accepted, _ = run(seed, **kw)
    assert mismatches == 0
    assert self_drafted > 0, "no self-drafted step was planned"
    assert 0 <= accepted <= drafted
