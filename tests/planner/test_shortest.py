"""`choose_shortest`: fewest tokens left first, at least two, enough batches; a training job
keeps its turn unless a newcomer with fewer tokens left pushes it out."""

from megatron_lorafusion.planner.shortest import Candidate, choose_shortest


def test_a_fresh_choice_takes_the_shortest_until_two_batches_fill_the_tokens():
    jobs = [
        Candidate(0, 900, 100, False),
        Candidate(1, 100, 30, False),
        Candidate(2, 500, 50, False),
    ]
    assert choose_shortest(jobs, 60) == [1, 2]
    assert choose_shortest(jobs, 81) == [1, 2, 0], "30 + 50 < 81: the third is needed"
    assert choose_shortest(jobs, 1) == [1, 2], "at least two"
    assert choose_shortest(jobs[:1], 1) == [0]


def test_a_training_job_overtaken_by_another_keeps_its_turn():
    # C's large batches brought it below B: A and C fill the tokens, yet B was training.
    jobs = [Candidate(0, 100, 10, True), Candidate(1, 400, 10, True), Candidate(2, 300, 90, True)]
    assert choose_shortest(jobs, 100) == [0, 2, 1]


def test_a_shorter_newcomer_pushes_the_longest_training_job_out():
    jobs = [Candidate(0, 900, 50, True), Candidate(1, 500, 50, True), Candidate(2, 80, 50, False)]
    assert choose_shortest(jobs, 100) == [2, 1]
    waiting = [
        Candidate(0, 900, 50, False),
        Candidate(1, 500, 50, True),
        Candidate(2, 80, 50, True),
    ]
    assert choose_shortest(waiting, 100) == [2, 1], "a longer waiting job waits on"


def test_jobs_with_nothing_left_are_not_chosen():
    jobs = [Candidate(0, 0, 50, True), Candidate(1, 10, 50, True), Candidate(2, 20, 50, False)]
    assert choose_shortest(jobs, 100) == [1, 2]
    assert choose_shortest([Candidate(0, 0, 50, True)], 100) == []
