package sandbox_test

import (
	"context"
	"fmt"
	"maps"
	"strings"
	"testing"
	"time"

	"github.com/deltagym/deltagym/sandbox"
)

// servicesImage imports the services image (the default image's packages
// with Debian's postgresql-15, redis-server and nodejs) built by
// `make image-services`, or skips; in CI ($CI set), where `make test`
// builds it first, a missing image fails the test instead.
func servicesImage(t testing.TB, b *bundle) string {
	t.Helper()
	return importProjectImage(t, b, "services", servicesRootfs(t))
}

// servicesRootfs returns the root of the services image, or skips.
func servicesRootfs(t testing.TB) string {
	t.Helper()
	return projectRootfs(t, "services", "image-services", "usr/lib/postgresql/15/bin/postgres", "usr/bin/redis-server", "usr/bin/node")
}

// asPostgres runs what follows as the user postgres, which owns the
// cluster and which peer authentication lets connect as the role postgres.
const asPostgres = "setpriv --reuid=postgres --regid=postgres --init-groups "

// pgBin is the directory of Debian's PostgreSQL 15 binaries.
const pgBin = "/usr/lib/postgresql/15/bin/"

// service is one row of the service shapes: how to start it with its state
// at the checkpoint, how to change that state, and how to read it back.
type service struct {
	name string
	// start starts the service in s and gives it the checkpoint's state.
	start func(t testing.TB, s *sandbox.Sandbox)
	// change changes the state after the checkpoint (a write transaction,
	// a SET, a POST); state reads it back (a SELECT, a GET, a GET).
	change func(t testing.TB, s *sandbox.Sandbox)
	state  func(t testing.TB, s *sandbox.Sandbox) string
	// want is state at the checkpoint, changed after change.
	want, changed string
	// alive checks what must still run beside the state after a restore
	// (the connected clients); nil when state says it all.
	alive func(t testing.TB, s *sandbox.Sandbox, tag string)
}

// capture is what one checkpoint made of a command's processes: how
// ("template" or "criu", their Method), how many, and why the general path
// took them (their Reason, of which a row of serviceShapes names a part).
type capture struct {
	how string
	n   int
	why string
}

// matches reports whether c, as captured, is what want expects.
func (c capture) matches(want capture) bool {
	return c.how == want.how && c.n == want.n && strings.Contains(c.why, want.why)
}

// shell runs a bash command in s and returns its stdout; a non-zero exit
// fails t.
func shell(t testing.TB, s *sandbox.Sandbox, cmd string) string {
	t.Helper()
	res, err := s.Exec(t.Context(), sandbox.ExecRequest{Argv: []string{"bash", "-c", cmd}, Timeout: 30 * time.Second})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("%s: %v exit %d: %s %s", cmd, err, res.ExitCode, res.Stdout, res.Stderr)
	}
	return strings.TrimSpace(string(res.Stdout))
}

func background(t testing.TB, s *sandbox.Sandbox, cmd string) {
	t.Helper()
	if _, err := s.Exec(t.Context(), sandbox.ExecRequest{Argv: []string{"bash", "-c", cmd}, Background: true}); err != nil {
		t.Fatalf("%s: %v", cmd, err)
	}
}

// psqlClients is how many psql clients stay connected to the Postgres
// server, each reading SQL from the FIFO /tmp/psql<i> (which it holds open
// for reading and writing, so that it never sees end of file) and writing
// to /tmp/psql<i>.out.
const psqlClients = 3

// psql runs one SQL command through a fresh psql and returns its unaligned
// output.
func psql(t testing.TB, s *sandbox.Sandbox, sql string) string {
	t.Helper()
	return shell(t, s, asPostgres+pgBin+"psql -XAtq -v ON_ERROR_STOP=1 -c "+shellQuote(sql))
}

func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

var postgresService = service{
	name: "postgres",
	start: func(t testing.TB, s *sandbox.Sandbox) {
		// The cluster 15/main that the package made, with its default
		// configuration (shared_buffers 128MB, dynamic shared memory in
		// /dev/shm); /run/postgresql is made at boot on Debian.
		shell(t, s, "install -d -o postgres -g postgres -m 2775 /run/postgresql")
		background(t, s, "exec "+asPostgres+pgBin+"postgres -c config_file=/etc/postgresql/15/main/postgresql.conf")
		waitFor(t, s, asPostgres+pgBin+"psql -XAtqc 'select 1' >/dev/null 2>&1")
		if got := psql(t, s, "show shared_buffers"); got != "128MB" {
			t.Fatalf("shared_buffers %q, want the default configuration's 128MB", got)
		}
		psql(t, s, "create table kv (k int primary key, v text); insert into kv values (1, 'at-checkpoint')")
		for i := 1; i <= psqlClients; i++ {
			background(t, s, fmt.Sprintf("mkfifo /tmp/psql%d && exec env PGAPPNAME=client%d %s%spsql -XAtq 0<>/tmp/psql%d >/tmp/psql%d.out 2>&1", i, i, asPostgres, pgBin, i, i))
		}
		waitFor(t, s, fmt.Sprintf(`[ "$(%s%spsql -XAtqc "select count(*) from pg_stat_activity where application_name like 'client%%'")" = %d ]`, asPostgres, pgBin, psqlClients))
	},
	change: func(t testing.TB, s *sandbox.Sandbox) {
		psql(t, s, "begin; update kv set v = 'changed' where k = 1; insert into kv values (2, 'added'); commit")
	},
	state: func(t testing.TB, s *sandbox.Sandbox) string {
		return psql(t, s, "select string_agg(k || '=' || v, ',' order by k) from kv")
	},
	want:    "1=at-checkpoint",
	changed: "1=changed,2=added",
	alive: func(t testing.TB, s *sandbox.Sandbox, tag string) {
		// Each client answers through its own connection, which the
		// server still counts.
		for i := 1; i <= psqlClients; i++ {
			shell(t, s, fmt.Sprintf("echo \"select 'ping-%s-' || count(*) from kv;\" >/tmp/psql%d", tag, i))
		}
		for i := 1; i <= psqlClients; i++ {
			waitFor(t, s, fmt.Sprintf("grep -qx ping-%s-1 /tmp/psql%d.out", tag, i))
		}
		if got := psql(t, s, "select count(*) from pg_stat_activity where application_name like 'client%'"); got != fmt.Sprint(psqlClients) {
			t.Fatalf("%s: %s psql clients connected, want %d", tag, got, psqlClients)
		}
	},
}

var redisService = service{
	name: "redis",
	start: func(t testing.TB, s *sandbox.Sandbox) {
		background(t, s, "exec redis-server --port 6379 --bind 127.0.0.1 --save '' --appendonly no >/tmp/redis.log 2>&1")
		waitFor(t, s, `[ "$(redis-cli ping 2>/dev/null)" = PONG ]`)
		shell(t, s, "redis-cli mset a at-checkpoint b 2 c 3 >/dev/null")
	},
	change: func(t testing.TB, s *sandbox.Sandbox) {
		shell(t, s, "redis-cli set a changed >/dev/null; redis-cli del b >/dev/null")
	},
	state: func(t testing.TB, s *sandbox.Sandbox) string {
		return shell(t, s, `echo "$(redis-cli mget a b c | paste -sd,) keys=$(redis-cli dbsize)"`)
	},
	want:    "at-checkpoint,2,3 keys=3",
	changed: "changed,,3 keys=2",
}

// redisClientService is redisService with a redis-cli client connected
// over TCP, reading commands from the FIFO /tmp/rc (held open for reading
// and writing) and writing its answers to /tmp/rc.out.
var redisClientService = service{
	name: "redis+client",
	start: func(t testing.TB, s *sandbox.Sandbox) {
		redisService.start(t, s)
		background(t, s, "mkfifo /tmp/rc && exec redis-cli 0<>/tmp/rc >/tmp/rc.out 2>&1")
		waitFor(t, s, `[ "$(redis-cli client list | wc -l)" = 2 ]`)
	},
	change:  redisService.change,
	state:   redisService.state,
	want:    redisService.want,
	changed: redisService.changed,
	// A copy's connection comes back reset: the client's next command
	// fails ("Broken pipe") and it connects again for the one after.
	alive: func(t testing.TB, s *sandbox.Sandbox, tag string) {
		shell(t, s, "echo 'echo ping-"+tag+"' >/tmp/rc")
		waitFor(t, s, "grep -qx ping-"+tag+" /tmp/rc.out || { echo 'echo ping-"+tag+"' >/tmp/rc; false; }")
	},
}

// nodeCounterJS is an HTTP server holding a counter in memory: GET answers
// it, POST adds one and answers it.
const nodeCounterJS = `
const http = require('http');
let n = 0;
http.createServer((req, res) => {
  if (req.method === 'POST') n++;
  res.end(String(n));
}).listen(8080, '127.0.0.1', () => require('fs').writeFileSync('/tmp/node-ready', ''));
`

// httpSh makes the request $1 / to 127.0.0.1:8080 with bash alone and
// prints the response's body.
const httpSh = `exec 3<>/dev/tcp/127.0.0.1/8080
printf '%s / HTTP/1.0\r\nContent-Length: 0\r\n\r\n' "$1" >&3
sed '1,/^\r$/d' <&3
`

var nodeService = service{
	name: "node",
	start: func(t testing.TB, s *sandbox.Sandbox) {
		must(t, s.WriteFile(t.Context(), "/tmp/counter.js", []byte(nodeCounterJS), 0o644, false))
		must(t, s.WriteFile(t.Context(), "/tmp/http.sh", []byte(httpSh), 0o755, false))
		background(t, s, "exec node /tmp/counter.js >/tmp/node.log 2>&1")
		waitFor(t, s, "[ -e /tmp/node-ready ]")
		for range 3 {
			shell(t, s, "/tmp/http.sh POST")
		}
	},
	change: func(t testing.TB, s *sandbox.Sandbox) { shell(t, s, "/tmp/http.sh POST") },
	state:  func(t testing.TB, s *sandbox.Sandbox) string { return shell(t, s, "/tmp/http.sh GET") },
	want:   "3", changed: "4",
}

// serviceShapes is the table of the service shapes: the mechanism each
// checkpoint gives the processes of each command, or why it refuses the
// checkpoint (docs/PROCESS-SHAPES.md, "Services").
var serviceShapes = []struct {
	svc  service
	want map[string]capture
	// refused, if set, is what the error of the checkpoint says: the
	// service cannot be checkpointed with its processes.
	refused string
}{
	// Postgres attaches a System V shared memory segment (its interlock,
	// whatever shared_memory_type), which CRIU saves only with the IPC
	// namespace, and a sandbox's is not saved: the checkpoint says so.
	{svc: postgresService, refused: "attaches System V shared memory"},
	// Redis (its background I/O threads) and Node (V8's and libuv's
	// threads) are multi-threaded: template copies, every thread.
	{svc: redisService, want: map[string]capture{"redis-server": {"template", 1, ""}}},
	// A client connected over TCP: both are templates, and each copy's
	// connection comes back reset; the client connects again.
	{svc: redisClientService, want: map[string]capture{"redis-server": {"template", 1, ""}, "redis-cli": {"template", 1, ""}}},
	{svc: nodeService, want: map[string]capture{"node": {"template", 1, ""}}},
}

// capturedBy sums up ck's processes by command.
func capturedBy(ck sandbox.CheckpointInfo) map[string]capture {
	got := map[string]capture{}
	for _, p := range ck.Processes {
		c := got[p.Command]
		how := p.Method.String()
		if c.how != "" && c.how != how {
			how = c.how + "+" + how
		}
		got[p.Command] = capture{how, c.n + 1, c.why + p.Reason}
	}
	return got
}

// TestServiceShapes checkpoints a Postgres server with three connected
// psql clients, a Redis server alone and with a connected client, and a
// Node HTTP server, each in a sandbox of its own; changes their state; restores in place, forks three times and,
// after a restart of the runtime, restores in a new sandbox, reading the
// state back by a query each time. It asserts the mechanism each service's
// processes got, or the checkpoint's refusal (serviceShapes).
func TestServiceShapes(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	img := servicesImage(t, b)
	cks := make([]string, len(serviceShapes))
	for i, row := range serviceShapes {
		s := b.create(t, sandbox.Spec{Image: img})
		row.svc.start(t, s)
		if got := row.svc.state(t, s); got != row.svc.want {
			t.Fatalf("%s: state %q before the checkpoint, want %q", row.svc.name, got, row.svc.want)
		}
		ck, err := s.Checkpoint(t.Context())
		if row.refused != "" {
			if err == nil || !strings.Contains(err.Error(), row.refused) {
				t.Errorf("%s: checkpoint %+v, %v; want it refused, saying %q", row.svc.name, ck.Processes, err, row.refused)
			}
			t.Logf("%s: checkpoint refused: %v", row.svc.name, err)
			// The refusal leaves the service as it was.
			checkService(t, row.svc, s, "refused")
			continue
		}
		if err != nil {
			t.Fatalf("%s: checkpoint: %v", row.svc.name, err)
		}
		t.Logf("%s: %+v", row.svc.name, ck.Processes)
		if got := capturedBy(ck); !maps.EqualFunc(got, row.want, capture.matches) {
			t.Errorf("%s: captured %+v, want %+v", row.svc.name, got, row.want)
		}
		cks[i] = ck.ID
		rollBackService(t, b, row.svc, s, ck.ID)
	}
	b.restart(t)
	for i, row := range serviceShapes {
		if cks[i] == "" {
			continue
		}
		kids, err := b.rt.Fork(t.Context(), cks[i], 1, sandbox.Spec{})
		if err != nil {
			t.Fatalf("%s: restore after a restart: %v", row.svc.name, err)
		}
		t.Cleanup(func() { _ = kids[0].Destroy(context.Background()) })
		checkService(t, row.svc, kids[0], "restart")
	}
}

// rollBackService changes svc's state in s after checkpoint ck, restores
// s in place and forks ck three times, and checks the state in each.
func rollBackService(t *testing.T, b *bundle, svc service, s *sandbox.Sandbox, ck string) {
	t.Helper()
	ctx := t.Context()
	svc.change(t, s)
	if got := svc.state(t, s); got != svc.changed {
		t.Fatalf("%s: state %q after the change, want %q", svc.name, got, svc.changed)
	}
	if err := s.Restore(ctx, ck); err != nil {
		t.Fatalf("%s: restore in place: %v", svc.name, err)
	}
	checkService(t, svc, s, "restored")
	kids, err := b.rt.Fork(ctx, ck, 3, sandbox.Spec{})
	if err != nil {
		t.Fatalf("%s: fork: %v", svc.name, err)
	}
	for k, kid := range kids {
		t.Cleanup(func() { _ = kid.Destroy(context.Background()) })
		checkService(t, svc, kid, fmt.Sprintf("fork%d", k))
		// Each child goes its own way, apart from the others.
		svc.change(t, kid)
	}
	checkService(t, svc, s, "parent")
}

// checkService checks that svc in s is at its checkpoint's state, and
// still has what must run beside it.
func checkService(t testing.TB, svc service, s *sandbox.Sandbox, tag string) {
	t.Helper()
	if got := svc.state(t, s); got != svc.want {
		t.Fatalf("%s, %s: state %q, want %q", svc.name, tag, got, svc.want)
	}
	if svc.alive != nil {
		svc.alive(t, s, tag)
	}
}
