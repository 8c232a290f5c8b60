/*
 * probe: a process that holds state of every kind a checkpoint must bring
 * back, changes all of it on SIGUSR1 and reports all of it on SIGUSR2, for
 * the process-shape conformance test (sandbox/shapes_test.go).
 *
 *   probe [-d] [-T] [-t THREADS] [-w WORKERS] [-o | -i] [-n ROLE]
 *
 *   -d  double-fork into a daemon (own session, parent init) first
 *   -T  hold no established TCP connection (the listening socket stays)
 *   -t  run THREADS threads in all (the main one included), each with its
 *       own signal mask and thread-local value
 *   -w  fork WORKERS children, each fed by a pipe from this process
 *   -o  write the pipe protocol to stdout (a pipeline's first stage)
 *   -i  read it from stdin (a pipeline's second stage)
 *   -n  the role named in reports (default "main")
 *
 * State, per process: a 1 MiB buffer with a pattern and a counter; a file
 * open at an offset; a TCP and a unix socket listening, each with one
 * connection to itself established; cwd; an environment variable; signal
 * dispositions; an interval timer (setitimer) and a timerfd; the pipe it
 * writes or reads (workers, pipelines).
 *
 * Reports go to $PROBE_DIR (default /tmp/probe)/<pid>.report, written to a
 * temporary name and renamed, as key=value lines, the first "token=" with
 * the content of $PROBE_DIR/token when the report was asked for. Once set
 * up, each process writes $PROBE_DIR/<role>.ready.
 *
 * The pipe protocol: "gen N" when the writer's state changes, "sync TOKEN"
 * when it reports. A reader asked to report first reads the pipe up to
 * that sync line, so its report holds every change the writer made before
 * its own report, whatever order the two handled their signals in.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/timerfd.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#define MEM_SIZE (1 << 20)
#define MAX_THREADS 16
#define MAX_WORKERS 8
#define BASE_TIMER 1000 /* seconds: the timers never fire during a test */

static const char *dir = "/tmp/probe";
static char role[64] = "main";
static int gen;                    /* how many changes this process made */
static unsigned char *mem;         /* MEM_SIZE bytes, pattern of (gen, counter) */
static unsigned long counter;      /* bumped by every change */
static int file_fd = -1;           /* $dir/<role>.dat, at an offset */
static int tcp_listen = -1, tcp_cli = -1, tcp_srv = -1;
static int unix_listen = -1, unix_cli = -1, unix_srv = -1;
static char unix_path[108];
static int timer_fd = -1;
static int sock_gen = -1;          /* the last gen received over the connections */
static int pipe_out[MAX_WORKERS];  /* write ends: workers' pipes, or stdout (-o) */
static int npipe_out;
static int pipe_in = -1;           /* read end: a worker's pipe, or stdin (-i) */
static int pipe_gen = -1;          /* the last gen read from pipe_in */
static int nthreads = 1;
static int no_tcp_conn;            /* -T */

static volatile sig_atomic_t want_change, want_report, alarms;

static void die(const char *fmt, ...) {
	va_list ap;
	va_start(ap, fmt);
	fprintf(stderr, "probe %s: ", role);
	vfprintf(stderr, fmt, ap);
	fprintf(stderr, ": %s\n", strerror(errno));
	va_end(ap);
	exit(1);
}

static void on_signal(int sig) {
	if (sig == SIGUSR1)
		want_change = 1;
	else if (sig == SIGUSR2)
		want_report = 1;
	else if (sig == SIGALRM)
		alarms++;
}

/* Threads: each has its own thread-local value and signal mask; the main
 * thread asks them to change or to say what they hold, one request at a
 * time, under mu. */
static __thread int tls_value;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int req_seq, req_kind; /* 1 change, 2 report */
static int done_count;
static struct {
	pid_t tid;
	int tls;
} slots[MAX_THREADS];

static void thread_mask(int i, int g) {
	/* Process-directed signals go to the main thread; each thread blocks
	 * a real-time signal of its own, and another after each change. */
	sigset_t set;
	sigemptyset(&set);
	sigaddset(&set, SIGUSR1);
	sigaddset(&set, SIGUSR2);
	sigaddset(&set, SIGALRM);
	sigaddset(&set, SIGTERM);
	sigaddset(&set, SIGRTMIN + i);
	if (g > 0)
		sigaddset(&set, SIGRTMIN + 16 + (i + g) % 8);
	pthread_sigmask(SIG_SETMASK, &set, NULL);
}

static void *thread_main(void *arg) {
	int i = (int)(intptr_t)arg;
	int seen = 0, g = 0;
	thread_mask(i, 0);
	tls_value = 1000 * i;
	pthread_mutex_lock(&mu);
	slots[i].tid = gettid();
	slots[i].tls = tls_value;
	for (;;) {
		while (req_seq == seen)
			pthread_cond_wait(&cv, &mu);
		seen = req_seq;
		if (req_kind == 1) {
			g++;
			tls_value = 1000 * i + g;
			thread_mask(i, g);
		}
		slots[i].tid = gettid();
		slots[i].tls = tls_value;
		done_count++;
		pthread_cond_broadcast(&cv);
	}
	return NULL;
}

/* ask_threads makes every thread but the main one run request kind and
 * waits for them all. */
static void ask_threads(int kind) {
	if (nthreads == 1)
		return;
	pthread_mutex_lock(&mu);
	req_kind = kind;
	req_seq++;
	done_count = 0;
	pthread_cond_broadcast(&cv);
	while (done_count < nthreads - 1)
		pthread_cond_wait(&cv, &mu);
	pthread_mutex_unlock(&mu);
}

static void fill_mem(void) {
	for (size_t i = 0; i < MEM_SIZE; i++)
		mem[i] = (unsigned char)(i * 31 + gen * 7 + counter);
}

static int check_mem(void) {
	for (size_t i = 0; i < MEM_SIZE; i++)
		if (mem[i] != (unsigned char)(i * 31 + gen * 7 + counter))
			return 0;
	return 1;
}

static unsigned long sum(const unsigned char *p, size_t n) {
	unsigned long h = 5381;
	for (size_t i = 0; i < n; i++)
		h = h * 33 + p[i];
	return h;
}

static void set_timers(int g) {
	struct itimerval it = {{BASE_TIMER * (g + 1), 0}, {BASE_TIMER * (g + 1), 0}};
	if (setitimer(ITIMER_REAL, &it, NULL) < 0)
		die("setitimer");
	struct itimerspec ts = {{BASE_TIMER * (g + 2), 0}, {BASE_TIMER * (g + 2), 0}};
	if (timerfd_settime(timer_fd, 0, &ts, NULL) < 0)
		die("timerfd_settime");
}

static void set_signals(int g) {
	struct sigaction sa = {0};
	sa.sa_handler = on_signal;
	sigemptyset(&sa.sa_mask);
	sigaction(SIGUSR1, &sa, NULL);
	sigaction(SIGUSR2, &sa, NULL);
	sigaction(SIGALRM, &sa, NULL);
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGPIPE, &(struct sigaction){.sa_handler = SIG_IGN}, NULL);
	/* The change swaps two dispositions: SIGINT ignored then caught,
	 * SIGQUIT caught then ignored. */
	sigaction(g ? SIGINT : SIGQUIT, &sa, NULL);
	sigaction(g ? SIGQUIT : SIGINT, &(struct sigaction){.sa_handler = SIG_IGN}, NULL);
}

static void set_cwd(int g) {
	char p[256];
	snprintf(p, sizeof p, "%s/cwd-%s-%d", dir, role, g);
	mkdir(p, 0755);
	if (chdir(p) < 0)
		die("chdir %s", p);
}

static void set_env(int g) {
	char v[16];
	snprintf(v, sizeof v, "%d", g);
	setenv("PROBE_GEN", v, 1);
}

static int listen_on(int fam) {
	int fd = socket(fam, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		die("socket");
	if (fam == AF_INET) {
		/* As servers do: a restore that binds the port again is not
		 * refused for connections in TIME_WAIT. */
		int one = 1;
		setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
		struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
		if (bind(fd, (struct sockaddr *)&a, sizeof a) < 0)
			die("bind tcp");
	} else {
		struct sockaddr_un a = {.sun_family = AF_UNIX};
		snprintf(unix_path, sizeof unix_path, "%s/%s.sock", dir, role);
		unlink(unix_path);
		strcpy(a.sun_path, unix_path);
		if (bind(fd, (struct sockaddr *)&a, sizeof a) < 0)
			die("bind %s", unix_path);
	}
	if (listen(fd, 8) < 0)
		die("listen");
	return fd;
}

/* connect_to connects a fresh socket to listener l; with srv, accepts the
 * connection into *srv, else accepts and closes it. */
static int connect_to(int l, int *srv) {
	struct sockaddr_storage a;
	socklen_t n = sizeof a;
	if (getsockname(l, (struct sockaddr *)&a, &n) < 0)
		return -1;
	int fd = socket(a.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -1;
	if (connect(fd, (struct sockaddr *)&a, n) < 0) {
		close(fd);
		return -1;
	}
	struct pollfd p = {.fd = l, .events = POLLIN};
	int s = poll(&p, 1, 5000) == 1 ? accept4(l, NULL, NULL, SOCK_CLOEXEC) : -1;
	if (s < 0) {
		close(fd);
		return -1;
	}
	if (srv) {
		*srv = s;
		return fd;
	}
	close(fd);
	close(s);
	return 0;
}

/* ping sends msg from cli to srv and back, and reports whether both came
 * through whole. */
static int ping(int cli, int srv, const char *msg) {
	char buf[64];
	size_t n = strlen(msg);
	struct pollfd p = {.events = POLLIN};
	for (int k = 0; k < 2; k++) {
		int from = k ? srv : cli, to = k ? cli : srv;
		if (write(from, msg, n) != (ssize_t)n)
			return 0;
		p.fd = to;
		if (poll(&p, 1, 5000) != 1 || read(to, buf, sizeof buf) != (ssize_t)n || memcmp(buf, msg, n))
			return 0;
	}
	return 1;
}

/* send_gen sends the process's gen over both connections and records it as
 * received on the other end. */
static void send_gen(void) {
	char msg[32];
	snprintf(msg, sizeof msg, "gen %d", gen);
	if ((no_tcp_conn || ping(tcp_cli, tcp_srv, msg)) && ping(unix_cli, unix_srv, msg))
		sock_gen = gen;
}

static void pipe_send(const char *line) {
	for (int i = 0; i < npipe_out; i++) {
		size_t n = strlen(line);
		if (write(pipe_out[i], line, n) != (ssize_t)n)
			die("writing the pipe");
	}
}

/* pipe_sync reads pipe_in up to the line "sync <token>"; it reports
 * whether the line came within 10 s. */
static int pipe_sync(const char *token) {
	static char buf[4096];
	static size_t have;
	char want[128];
	snprintf(want, sizeof want, "sync %s", token);
	for (;;) {
		char *nl;
		while ((nl = memchr(buf, '\n', have))) {
			*nl = 0;
			int g;
			int found = strcmp(buf, want) == 0;
			if (sscanf(buf, "gen %d", &g) == 1)
				pipe_gen = g;
			have -= nl + 1 - buf;
			memmove(buf, nl + 1, have);
			if (found)
				return 1;
		}
		struct pollfd p = {.fd = pipe_in, .events = POLLIN};
		if (poll(&p, 1, 10000) != 1)
			return 0;
		ssize_t n = read(pipe_in, buf + have, sizeof buf - have);
		if (n <= 0)
			return 0;
		have += n;
	}
}

static void change(void) {
	gen++;
	counter++;
	fill_mem();
	char c = 'a' + gen;
	if (write(file_fd, &c, 1) != 1 || lseek(file_fd, 100 * gen, SEEK_CUR) < 0)
		die("changing the file");
	set_cwd(gen);
	set_env(gen);
	set_signals(gen);
	set_timers(gen);
	send_gen();
	ask_threads(1);
	char line[32];
	snprintf(line, sizeof line, "gen %d\n", gen);
	pipe_send(line);
}

static void status_field(char *out, size_t n, const char *path, const char *key) {
	char buf[4096];
	snprintf(out, n, "?");
	FILE *f = fopen(path, "r");
	if (!f)
		return;
	size_t kl = strlen(key);
	while (fgets(buf, sizeof buf, f))
		if (!strncmp(buf, key, kl) && buf[kl] == ':') {
			char *v = buf + kl + 1;
			v += strspn(v, " \t");
			v[strcspn(v, "\n")] = 0;
			snprintf(out, n, "%s", v);
			break;
		}
	fclose(f);
}

static void read_token(char *tok, size_t n) {
	char p[256];
	snprintf(p, sizeof p, "%s/token", dir);
	int fd = open(p, O_RDONLY | O_CLOEXEC);
	ssize_t r = fd < 0 ? 0 : read(fd, tok, n - 1);
	if (fd >= 0)
		close(fd);
	tok[r > 0 ? r : 0] = 0;
	tok[strcspn(tok, "\n")] = 0;
}

static void report_process(FILE *f) {
	pid_t pid = getpid(), ppid = getppid();
	char comm[64] = "?", p[64];
	snprintf(p, sizeof p, "/proc/%d/comm", ppid);
	FILE *c = fopen(p, "r");
	if (c) {
		if (fgets(comm, sizeof comm, c))
			comm[strcspn(comm, "\n")] = 0;
		fclose(c);
	}
	fprintf(f, "pid=%d\nppid=%d\nppid_comm=%s\npgid=%d\nsid=%d\n", pid, ppid, comm, getpgid(0), getsid(0));
	fprintf(f, "leads_group=%d\nleads_session=%d\n", getpgid(0) == pid, getsid(0) == pid);
	char cwd[256];
	fprintf(f, "cwd=%s\nenv_gen=%s\nenv_tag=%s\n", getcwd(cwd, sizeof cwd) ? cwd : "?",
		getenv("PROBE_GEN") ? getenv("PROBE_GEN") : "", getenv("PROBE_TAG") ? getenv("PROBE_TAG") : "");
	fprintf(f, "gen=%d\ncounter=%lu\nmem_ok=%d\nmem_sum=%lu\n", gen, counter, check_mem(), sum(mem, MEM_SIZE));
	unsigned char fb[4096];
	ssize_t n = pread(file_fd, fb, sizeof fb, 0);
	fprintf(f, "file_off=%lld\nfile_sum=%lu\n", (long long)lseek(file_fd, 0, SEEK_CUR), n > 0 ? sum(fb, n) : 0);
}

static void report_signals_timers(FILE *f) {
	char v[64];
	const char *keys[] = {"SigIgn", "SigCgt", "SigBlk"};
	for (int i = 0; i < 3; i++) {
		status_field(v, sizeof v, "/proc/thread-self/status", keys[i]);
		fprintf(f, "%s=%s\n", keys[i], v);
	}
	struct itimerval it;
	getitimer(ITIMER_REAL, &it);
	fprintf(f, "itimer_interval=%ld\nitimer_value=%ld\nalarms=%d\n", (long)it.it_interval.tv_sec, (long)it.it_value.tv_sec, (int)alarms);
	struct itimerspec ts;
	timerfd_gettime(timer_fd, &ts);
	fprintf(f, "timerfd_interval=%ld\ntimerfd_value=%ld\n", (long)ts.it_interval.tv_sec, (long)ts.it_value.tv_sec);
}

static void report_sockets(FILE *f, const char *token) {
	struct sockaddr_in a;
	socklen_t n = sizeof a;
	getsockname(tcp_listen, (struct sockaddr *)&a, &n);
	fprintf(f, "tcp_port=%d\n", ntohs(a.sin_port));
	n = sizeof a;
	a.sin_port = 0;
	if (!no_tcp_conn)
		getpeername(tcp_cli, (struct sockaddr *)&a, &n);
	fprintf(f, "tcp_conn_peer=%d\n", ntohs(a.sin_port));
	fprintf(f, "unix_path=%s\nsock_gen=%d\n", unix_path, sock_gen);
	fprintf(f, "tcp_accepts=%d\nunix_accepts=%d\n", connect_to(tcp_listen, NULL) == 0, connect_to(unix_listen, NULL) == 0);
	fprintf(f, "tcp_conn=%d\nunix_conn=%d\n", no_tcp_conn ? -1 : ping(tcp_cli, tcp_srv, token), ping(unix_cli, unix_srv, token));
}

static void report_threads(FILE *f) {
	ask_threads(2);
	fprintf(f, "threads=%d\n", nthreads);
	for (int i = 1; i < nthreads; i++) {
		char p[64], v[64];
		snprintf(p, sizeof p, "/proc/self/task/%d/status", slots[i].tid);
		status_field(v, sizeof v, p, "SigBlk");
		fprintf(f, "thread%d_tls=%d\nthread%d_sigblk=%s\n", i, slots[i].tls, i, v);
	}
	fprintf(f, "thread0_tls=%d\n", tls_value);
}

static void report(void) {
	char token[64], tmp[256], final[256];
	read_token(token, sizeof token);
	char line[128];
	snprintf(line, sizeof line, "sync %s\n", token);
	pipe_send(line);
	snprintf(tmp, sizeof tmp, "%s/.%d.tmp", dir, getpid());
	snprintf(final, sizeof final, "%s/%d.report", dir, getpid());
	FILE *f = fopen(tmp, "w");
	if (!f)
		die("creating %s", tmp);
	fprintf(f, "token=%s\nrole=%s\n", token, role);
	if (pipe_in >= 0) {
		int ok = pipe_sync(token);
		fprintf(f, "pipe=%d\npipe_gen=%d\n", ok, pipe_gen);
	}
	report_process(f);
	report_signals_timers(f);
	report_sockets(f, token);
	report_threads(f);
	if (fclose(f) || rename(tmp, final) < 0)
		die("writing %s", final);
}

static void daemonize(void) {
	pid_t p = fork();
	if (p < 0)
		die("fork");
	if (p > 0)
		_exit(0);
	setsid();
	p = fork();
	if (p < 0)
		die("fork");
	if (p > 0)
		_exit(0);
	int fd = open("/dev/null", O_RDWR);
	dup2(fd, 0);
	dup2(fd, 1);
	dup2(fd, 2);
	if (fd > 2)
		close(fd);
}

/* spawn_workers forks n workers, each reading a pipe from this process. */
static void spawn_workers(int n) {
	for (int i = 0; i < n; i++) {
		int p[2];
		if (pipe2(p, O_CLOEXEC) < 0)
			die("pipe");
		pid_t pid = fork();
		if (pid < 0)
			die("fork");
		if (pid == 0) {
			for (int j = 0; j < npipe_out; j++)
				close(pipe_out[j]);
			npipe_out = 0;
			close(p[1]);
			pipe_in = p[0];
			snprintf(role, sizeof role, "worker%d", i + 1);
			return;
		}
		close(p[0]);
		pipe_out[npipe_out++] = p[1];
	}
}

static void setup_state(void) {
	mem = malloc(MEM_SIZE);
	if (!mem)
		die("malloc");
	fill_mem();
	char p[256];
	snprintf(p, sizeof p, "%s/%s.dat", dir, role);
	file_fd = open(p, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (file_fd < 0)
		die("open %s", p);
	char block[1024];
	for (size_t i = 0; i < sizeof block; i++)
		block[i] = 'A' + i % 26;
	if (write(file_fd, block, sizeof block) != sizeof block || lseek(file_fd, 100, SEEK_SET) < 0)
		die("writing %s", p);
	tcp_listen = listen_on(AF_INET);
	unix_listen = listen_on(AF_UNIX);
	if (!no_tcp_conn)
		tcp_cli = connect_to(tcp_listen, &tcp_srv);
	unix_cli = connect_to(unix_listen, &unix_srv);
	if ((!no_tcp_conn && tcp_cli < 0) || unix_cli < 0)
		die("connecting to itself");
	timer_fd = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC);
	if (timer_fd < 0)
		die("timerfd_create");
	set_cwd(0);
	set_env(0);
	set_signals(0);
	set_timers(0);
	send_gen();
	pipe_send("gen 0\n");
}

static void start_threads(void) {
	for (int i = 1; i < nthreads; i++) {
		pthread_t t;
		if (pthread_create(&t, NULL, thread_main, (void *)(intptr_t)i))
			die("pthread_create");
	}
	/* Every thread holds its slot once it has taken mu. */
	for (;;) {
		int ready = 1;
		pthread_mutex_lock(&mu);
		for (int i = 1; i < nthreads; i++)
			ready &= slots[i].tid != 0;
		pthread_mutex_unlock(&mu);
		if (ready)
			break;
		sched_yield();
	}
}

int main(int argc, char **argv) {
	int daemon = 0, workers = 0, opt;
	if (getenv("PROBE_DIR"))
		dir = getenv("PROBE_DIR");
	while ((opt = getopt(argc, argv, "dTt:w:oin:")) != -1) {
		switch (opt) {
		case 'd': daemon = 1; break;
		case 'T': no_tcp_conn = 1; break;
		case 't': nthreads = atoi(optarg); break;
		case 'w': workers = atoi(optarg); break;
		case 'o': pipe_out[npipe_out++] = 1; break;
		case 'i': pipe_in = 0; break;
		case 'n': snprintf(role, sizeof role, "%s", optarg); break;
		default:
			fprintf(stderr, "usage: probe [-d] [-T] [-t threads] [-w workers] [-o | -i] [-n role]\n");
			return 2;
		}
	}
	if (nthreads < 1 || nthreads > MAX_THREADS || workers < 0 || workers > MAX_WORKERS)
		return 2;
	mkdir(dir, 0755);
	if (daemon)
		daemonize();
	/* Signals that ask for a change or a report wait, blocked, for the
	 * main loop's sigsuspend. */
	sigset_t block, wait;
	sigemptyset(&block);
	sigaddset(&block, SIGUSR1);
	sigaddset(&block, SIGUSR2);
	sigprocmask(SIG_BLOCK, &block, &wait);
	sigdelset(&wait, SIGUSR1);
	sigdelset(&wait, SIGUSR2);
	if (workers)
		spawn_workers(workers);
	setup_state();
	start_threads();
	char p[256];
	snprintf(p, sizeof p, "%s/%s.ready", dir, role);
	int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd < 0 || close(fd))
		die("creating %s", p);
	for (;;) {
		while (!want_change && !want_report)
			sigsuspend(&wait);
		if (want_change) {
			want_change = 0;
			change();
		}
		if (want_report) {
			want_report = 0;
			report();
		}
	}
}
