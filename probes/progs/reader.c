/* kph-reader: the guest's kernel log, as `dmesg` prints it, and whole files, on the
 * machine's reader port, with no process made and no guest agent request.
 *
 * `dmesg` is a process (a fork under TCG) and formats the whole log buffer each time
 * (syslog(SYSLOG_ACTION_READ_ALL): every record, ~10 ms of guest time for a freshly booted
 * guest's 250 records under TCG), and the harness reads it twice a run, before and after
 * the run's window (harness/machine/kwatch.py). A file read through qemu-ga is three
 * requests (open, read, close), each ~0.5 ms of the guest's one vCPU. This daemon,
 * started by the image's init before the guest agent, holds /dev/kmsg open, so each log
 * answer formats only the records printed since the last one (kernel/printk/printk.c:
 * devkmsg_read(), a reader's own sequence number), and reads files with plain syscalls.
 *
 * The port is the virtio-serial port named org.kprobe_harness.reader.0. A request is one
 * line: "a ID" (the log from the first record the buffer still holds:
 * lseek(SEEK_SET), devkmsg_llseek()), "n ID" (the records since the last answer), or
 * "f ID N" followed by N lines, each a path. The answer is the line "KPH ID LEN" and LEN
 * bytes: the log's text, or for each file "D 0 LEN\n" and its bytes, "O ERRNO 0\n" when
 * open() failed or "R ERRNO 0\n" when a read() did (what was read is dropped, as qemu-ga's
 * guest-file-read drops it). Files are opened O_NONBLOCK, as qemu-ga opens them, so a
 * file with nothing to read yet fails with EAGAIN rather than hold the daemon.
 * "p ID MAX" followed by one line, a path, reads a file whose every read() is one piece
 * (trace_pipe_raw: one ring-buffer page a read, tracing_buffers_read()) up to MAX reads,
 * keeping each: the answer is "P ERRNO COUNT END\n" (END 1 when a read found nothing
 * more: EAGAIN or end of file; ERRNO that of a failed read(), what was read before it
 * kept; "O ERRNO 0 0" when open() failed), then COUNT pieces, each "LEN\n" and its
 * bytes. The ring buffer's pages come this way without a process and without base64.
 * "w ID N" followed by N lines writes probe lines as EventsBackend.register()'s shell
 * script writes them (harness/backends/events.py), without a process and without the
 * shell's reads of a byte a read(): each line a 0x1f-separated list, "P DIR KB" (the
 * tracing directory; tracing_on 0, trace emptied, buffer_size_kb KB unless it is),
 * "L FILE LINE ENABLE REMOVE" (error_log emptied, LINE appended to FILE, then ENABLE
 * written 1 and 0, or when that fails REMOVE appended to FILE; no ENABLE for a removal
 * line), "T FILE LINE" (error_log emptied, LINE appended to FILE, and when FILE took it,
 * FILE emptied: `echo > FILE`) and "C DIR" (the names in DIR that start with "cpu"). The
 * answer is the script's
 * text: "@ok", or "@errw ERRNO" (the write failed) or "@erro ERRNO" (the open did) and
 * then the error_log entry as kph_log prints it (its first line, its command line, "caret
 * N" with N the caret line's length) or "enable: error: failed"; "@cpus" and the names.
 *
 * A log record is printed as syslog(READ_ALL) prints it less the "<level>" that busybox's
 * dmesg strips: each line of its text after the prefix "[%5lu.%06lu] " (printk_time on;
 * info_print_prefix(), print_time()), then "[%6s]" of the caller with
 * CONFIG_PRINTK_CALLER (print_caller()); devkmsg_read()'s escapes (\xHH for a control
 * character, a byte >= 127 and the backslash: msg_add_ext_text()) are undone. Records
 * the buffer overwrote before they were read (EPIPE) are gone, as they are from dmesg.
 */
#define _GNU_SOURCE         /* memmem() */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define PORT_NAME "org.kprobe_harness.reader.0"
/* the most a file may hold (a larger one fails with EFBIG) */
#define FILE_MAX (256 << 20)

static char *out;
static size_t out_len, out_cap;

static void put(const char *s, size_t n)
{
	if (out_len + n > out_cap) {
		size_t cap = out_cap ? out_cap : 1 << 16;

		while (cap < out_len + n)
			cap *= 2;
		out = realloc(out, cap);
		if (!out)
			exit(2);
		out_cap = cap;
	}
	memcpy(out + out_len, s, n);
	out_len += n;
}

static int find_port(char *path, size_t size)
{
	DIR *d = opendir("/sys/class/virtio-ports");
	struct dirent *e;
	int found = 0;

	if (!d)
		return 0;
	while (!found && (e = readdir(d))) {
		char f[512], name[128];
		FILE *fp;

		if (e->d_name[0] == '.')
			continue;
		snprintf(f, sizeof(f), "/sys/class/virtio-ports/%s/name", e->d_name);
		fp = fopen(f, "r");
		if (!fp)
			continue;
		if (fgets(name, sizeof(name), fp)) {
			name[strcspn(name, "\n")] = 0;
			if (!strcmp(name, PORT_NAME)) {
				snprintf(path, size, "/dev/%s", e->d_name);
				found = 1;
			}
		}
		fclose(fp);
	}
	closedir(d);
	return found;
}

static int printk_time(void)
{
	char c = 'Y';
	int fd = open("/sys/module/printk/parameters/time", O_RDONLY);

	if (fd >= 0) {
		if (read(fd, &c, 1) != 1)
			c = 'Y';
		close(fd);
	}
	return c == 'Y' || c == 'y' || c == '1';
}

static int hexval(char c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	if (c >= 'A' && c <= 'F')
		return c - 'A' + 10;
	return -1;
}

/* One /dev/kmsg record: "PRI,SEQ,TS_USEC,FLAGS[,caller=X];TEXT\n" then " KEY=VALUE"
 * lines (msg_print_ext_body()'s device properties), which dmesg does not print. */
static void format_record(char *rec, size_t n, int with_time)
{
	char *semi = memchr(rec, ';', n), *p, *end, prefix[64];
	unsigned long long ts = 0;
	char caller[32] = "";
	size_t plen = 0;
	int field = 0;

	if (!semi)
		return;
	*semi = 0;
	for (p = strtok(rec, ","); p; p = strtok(NULL, ","), field++) {
		if (field == 2)
			ts = strtoull(p, NULL, 10);
		else if (!strncmp(p, "caller=", 7))
			snprintf(caller, sizeof(caller), "%s", p + 7);
	}
	if (with_time)
		plen = snprintf(prefix, sizeof(prefix), "[%5llu.%06llu]", ts / 1000000, ts % 1000000);
	if (caller[0])
		plen += snprintf(prefix + plen, sizeof(prefix) - plen, "[%6s]", caller);
	if (with_time || caller[0])
		prefix[plen++] = ' ';
	p = semi + 1;
	end = memchr(p, '\n', rec + n - p);
	if (!end)
		end = rec + n;
	put(prefix, plen);
	while (p < end) {
		char c = *p++;

		if (c == '\\' && end - p >= 3 && p[0] == 'x' && hexval(p[1]) >= 0 &&
		    hexval(p[2]) >= 0) {
			c = (char)(hexval(p[1]) * 16 + hexval(p[2]));
			p += 3;
		}
		put(&c, 1);
		if (c == '\n')
			put(prefix, plen);
	}
	put("\n", 1);
}

static void drain(int kmsg)
{
	static char rec[16384];
	int with_time = printk_time();

	for (;;) {
		ssize_t n = read(kmsg, rec, sizeof(rec) - 1);

		if (n < 0) {
			if (errno == EPIPE || errno == EINTR)
				continue;       /* EPIPE: overwritten records; the next is readable */
			break;                  /* EAGAIN: nothing more */
		}
		if (n == 0)
			break;
		rec[n] = 0;
		format_record(rec, (size_t)n, with_time);
	}
}

static void read_file(const char *path)
{
	char head[64];
	size_t at = out_len;
	ssize_t n;
	int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC), err = 0;

	if (fd < 0) {
		snprintf(head, sizeof(head), "O %d 0\n", errno);
		put(head, strlen(head));
		return;
	}
	put("D 0 0000000000\n", 15);           /* the length is filled in below */
	for (;;) {
		char buf[65536];

		n = read(fd, buf, sizeof(buf));
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0) {
			err = errno;
			break;
		}
		if (n == 0)
			break;
		if (out_len - at - 15 + (size_t)n > FILE_MAX) {
			err = EFBIG;
			break;
		}
		put(buf, (size_t)n);
	}
	close(fd);
	if (err) {
		out_len = at;
		snprintf(head, sizeof(head), "R %d 0\n", err);
		put(head, strlen(head));
		return;
	}
	snprintf(head, sizeof(head), "D 0 %010zu", out_len - at - 15);
	memcpy(out + at, head, 14);
}

static void read_pieces(const char *path, unsigned long max)
{
	char head[64];
	size_t at = out_len;
	unsigned long count = 0;
	int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC), err = 0, end = 0;

	put("P 000 0000000000 0\n", 19);        /* filled in below */
	if (fd < 0) {
		err = errno;
	} else {
		while (count < max) {
			char buf[4096];
			ssize_t n = read(fd, buf, sizeof(buf));

			if (n < 0 && errno == EINTR)
				continue;
			if (n < 0 && errno == EAGAIN) {
				end = 1;
				break;
			}
			if (n < 0) {
				err = errno;
				break;
			}
			if (n == 0) {
				end = 1;
				break;
			}
			if (out_len - at > FILE_MAX) {
				err = EFBIG;
				break;
			}
			snprintf(head, sizeof(head), "%zd\n", n);
			put(head, strlen(head));
			put(buf, (size_t)n);
			count++;
		}
		close(fd);
	}
	snprintf(head, sizeof(head), "%c %03d %010lu %d\n", fd < 0 ? 'O' : 'P',
		 err > 999 ? 999 : err, count, end);
	memcpy(out + at, head, 19);
}

static int write_all(int fd, const char *p, size_t n)
{
	while (n) {
		ssize_t w = write(fd, p, n);

		if (w < 0) {
			if (errno == EINTR || errno == EAGAIN)
				continue;
			return -1;
		}
		p += w;
		n -= (size_t)w;
	}
	return 0;
}

/* `echo TEXT > PATH` (`>> PATH` with append), as busybox's echo writes it: TEXT and a
 * newline in one write() (full_write(): a short write goes on). 0, or the errno of the
 * open (*opened 0) or of the write. */
static int echo_to(const char *path, const char *text, int append, int *opened)
{
	static char buf[16400];
	size_t n = strlen(text);
	int fd, err = 0;

	*opened = 0;
	fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC | (append ? O_APPEND : O_TRUNC), 0666);
	if (fd < 0)
		return errno;
	*opened = 1;
	if (n > sizeof(buf) - 1)
		n = sizeof(buf) - 1;
	memcpy(buf, text, n);
	buf[n++] = '\n';
	{
		const char *p = buf;

		while (n) {
			ssize_t w = write(fd, p, n);

			if (w < 0 && errno == EINTR)
				continue;
			if (w <= 0) {
				err = w < 0 ? errno : EIO;
				break;
			}
			p += w;
			n -= (size_t)w;
		}
	}
	close(fd);
	return err;
}

static void put_str(const char *s)
{
	put(s, strlen(s));
}

/* "@errw ERRNO" or "@erro ERRNO" */
static void put_err(int err, int opened)
{
	char head[32];

	snprintf(head, sizeof(head), "@err%c %d\n", opened ? 'w' : 'o', err);
	put_str(head);
}

/* kph_log of the script: the last error_log entry (kernel/trace/trace.c:
 * tracing_err_log_seq_show(): "[ts] SUBSYSTEM: error: MSG", "  Command: CMD", the caret
 * line), read whole, its complete lines taken as the script's `while read` loop takes
 * them: a line that starts with '[' and holds ": error: " starts an entry, the next two
 * are its command and caret. */
static void last_error(const char *log)
{
	static char buf[65536];
	size_t len = 0;
	const char *x = NULL, *c = NULL, *line;
	size_t xl = 0, cl = 0, p = 0;
	int n = 0, have_p = 0, fd = open(log, O_RDONLY | O_CLOEXEC);
	char num[32];

	if (fd < 0)
		return;
	for (;;) {
		ssize_t r = read(fd, buf + len, sizeof(buf) - len);

		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			break;
		len += (size_t)r;
		if (len == sizeof(buf))
			break;
	}
	close(fd);
	for (line = buf; line < buf + len;) {
		const char *nl = memchr(line, '\n', (size_t)(buf + len - line));
		size_t ll;

		if (!nl)
			break;          /* no newline: `read` fails, the loop ends */
		ll = (size_t)(nl - line);
		if (ll && line[0] == '[' && memmem(line, ll, ": error: ", 9)) {
			x = line;
			xl = ll;
			n = 1;
		} else if (n == 1) {
			c = line;
			cl = ll;
			n = 2;
		} else if (n == 2) {
			p = ll;
			have_p = 1;
			n = 0;
		}
		line = nl + 1;
	}
	if (!x || !xl)
		return;
	put(x, xl);
	put("\n", 1);
	if (c)
		put(c, cl);
	put("\n", 1);
	if (have_p)
		snprintf(num, sizeof(num), "caret %zu\n", p);
	else
		snprintf(num, sizeof(num), "caret \n");
	put_str(num);
}

static char tdir[256] = "/sys/kernel/tracing";

static void tracing_path(char *dst, size_t size, const char *name)
{
	snprintf(dst, size, "%s/%s", tdir, name);
}

/* error_log emptied, LINE appended to FILE: 0, or the errno after "@errw"/"@erro" and
 * the error_log entry are put out */
static int write_line(const char *file, const char *line)
{
	char log[300];
	int opened, err;

	tracing_path(log, sizeof(log), "error_log");
	close(open(log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666));
	err = echo_to(file, line, 1, &opened);
	if (err) {
		put_err(err, opened);
		last_error(log);
	}
	return err;
}

/* One line of a "w" request (see the top of this file). */
static void write_op(char *op)
{
	char *f[6] = { 0 }, path[512];
	int nf = 0, opened, err;

	while (nf < 6) {
		f[nf++] = op;
		op = strchr(op, 0x1f);
		if (!op)
			break;
		*op++ = 0;
	}
	if (!strcmp(f[0], "P") && nf == 3) {
		char kb[64] = "";
		int fd;

		snprintf(tdir, sizeof(tdir), "%s", f[1]);
		tracing_path(path, sizeof(path), "tracing_on");
		echo_to(path, "0", 0, &opened);
		tracing_path(path, sizeof(path), "trace");
		echo_to(path, "", 0, &opened);
		tracing_path(path, sizeof(path), "buffer_size_kb");
		fd = open(path, O_RDONLY | O_CLOEXEC);
		if (fd >= 0) {
			ssize_t r = read(fd, kb, sizeof(kb) - 1);

			kb[r > 0 ? r : 0] = 0;
			kb[strcspn(kb, " \t\n")] = 0;
			close(fd);
		}
		if (strcmp(kb, f[2]))
			echo_to(path, f[2], 0, &opened);
	} else if (!strcmp(f[0], "L") && nf == 5) {
		if (write_line(f[1], f[2]))
			return;
		if (!f[3][0]) {                 /* a removal: nothing to enable */
			put_str("@ok\n");
		} else if (!(err = echo_to(f[3], "1", 0, &opened))) {
			echo_to(f[3], "0", 0, &opened);
			put_str("@ok\n");
		} else {
			put_err(err, opened);
			put_str("enable: error: failed\n");
			echo_to(f[1], f[4], 1, &opened);
		}
	} else if (!strcmp(f[0], "T") && nf == 3) {
		if (!write_line(f[1], f[2])) {
			put_str("@ok\n");
			echo_to(f[1], "", 0, &opened);
		}
	} else if (!strcmp(f[0], "C") && nf == 2) {
		DIR *d = opendir(f[1]);
		struct dirent *e;

		put_str("@cpus\n");
		while (d && (e = readdir(d))) {
			if (!strncmp(e->d_name, "cpu", 3)) {
				put_str(e->d_name);
				put("\n", 1);
			}
		}
		if (d)
			closedir(d);
	}
}

static void answer(int port, unsigned long id)
{
	char head[64];

	snprintf(head, sizeof(head), "KPH %lu %zu\n", id, out_len);
	if (write_all(port, head, strlen(head)) < 0 || write_all(port, out, out_len) < 0)
		usleep(100000);
}

int main(void)
{
	static char req[16384];
	char path[300];
	size_t have = 0;
	unsigned long id = 0, files = 0;        /* an "f" request's paths still to come */
	unsigned long pieces = 0;               /* a "p" request's MAX, its path to come */
	unsigned long ops = 0;                  /* a "w" request's lines still to come */
	int port = -1, kmsg, i;

	for (i = 0; i < 500 && port < 0; i++) {     /* the port appears with virtio_console */
		if (find_port(path, sizeof(path)))
			port = open(path, O_RDWR);
		if (port < 0)
			usleep(10000);
	}
	if (port < 0) {
		fprintf(stderr, "kph-reader: no port named %s\n", PORT_NAME);
		return 1;
	}
	kmsg = open("/dev/kmsg", O_RDONLY | O_NONBLOCK);
	if (kmsg < 0) {
		perror("kph-reader: /dev/kmsg");
		return 1;
	}
	for (;;) {
		ssize_t n = read(port, req + have, sizeof(req) - 1 - have);
		char *nl;

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {           /* the host end is not connected: wait for it */
			usleep(100000);
			continue;
		}
		have += (size_t)n;
		while ((nl = memchr(req, '\n', have))) {
			size_t len = (size_t)(nl - req) + 1;

			*nl = 0;
			if (ops) {
				write_op(req);
				if (--ops == 0)
					answer(port, id);
			} else if (files) {
				read_file(req);
				if (--files == 0)
					answer(port, id);
			} else if (pieces) {
				read_pieces(req, pieces);
				pieces = 0;
				answer(port, id);
			} else if ((req[0] == 'a' || req[0] == 'n') && req[1] == ' ') {
				id = strtoul(req + 2, NULL, 10);
				if (req[0] == 'a')
					lseek(kmsg, 0, SEEK_SET);
				out_len = 0;
				drain(kmsg);
				answer(port, id);
			} else if ((req[0] == 'f' || req[0] == 'p' || req[0] == 'w') && req[1] == ' ') {
				/* "f ID N" or "p ID MAX": the lines that follow are paths;
				 * "w ID N": they are write ops */
				char *end;
				unsigned long n;

				id = strtoul(req + 2, &end, 10);
				n = strtoul(end, NULL, 10);
				out_len = 0;
				if (req[0] == 'f')
					files = n;
				else if (req[0] == 'w')
					ops = n;
				else
					pieces = n;
				if (!n)
					answer(port, id);
			}
			memmove(req, req + len, have - len);
			have -= len;
		}
		if (have == sizeof(req) - 1)    /* a line longer than any request: dropped */
			have = 0;
	}
}
