/* kph-rt PROGRAM [ARG...]: run PROGRAM (the guest agent, images/init) as a real-time
 * task, SCHED_FIFO priority 1 with SCHED_RESET_ON_FORK, so that what it spawns (every
 * command and workload of the harness) runs as the ordinary SCHED_OTHER task it would be.
 *
 * Why: qemu-ga reads a command's output with a GLib watch that closes the pipe as soon as
 * a poll reports G_IO_HUP alone (qga/commands.c: guest_exec_output_watch()). pipe_poll()
 * (fs/pipe.c) reads the ring's head and tail, then the writer count, locklessly: if the
 * agent is preempted between the two while the command writes its last bytes and exits,
 * the poll says "hung up" without "readable" and those bytes are dropped: an empty
 * "exit 0" for a `cat` that printed (seen in CI on 7.3, whose kernel preempts lazily in
 * kernel code). No SCHED_OTHER task preempts a SCHED_FIFO one, so on the harness's
 * one-vCPU guests the command cannot run inside the agent's poll at all.
 *
 * A kernel that refuses the policy (no RT group budget) leaves the agent as it was. */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	struct sched_param p = { .sched_priority = 1 };

	if (argc < 2) {
		fprintf(stderr, "usage: kph-rt PROGRAM [ARG...]\n");
		return 2;
	}
	if (sched_setscheduler(0, SCHED_FIFO | SCHED_RESET_ON_FORK, &p) != 0)
		fprintf(stderr, "kph-rt: SCHED_FIFO refused (%s): %s runs as it is\n",
			strerror(errno), argv[1]);
	execvp(argv[1], argv + 1);
	fprintf(stderr, "kph-rt: %s: %s\n", argv[1], strerror(errno));
	return 127;
}
