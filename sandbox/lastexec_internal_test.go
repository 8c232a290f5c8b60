package sandbox

import (
	"strings"
	"testing"
)

func TestLastExec(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"python3 -c 'import time\nwhile True: time.sleep(1)'", "exec python3 -c 'import time\nwhile True: time.sleep(1)'"},
		{"  python3 app.py > /tmp/log 2>&1", "  exec python3 app.py > /tmp/log 2>&1"},
		{"# the server\npython3 \"$HOME/app.py\"\n", "# the server\nexec python3 \"$HOME/app.py\"\n"},
		{">/tmp/log node server.js", "exec >/tmp/log node server.js"},
		{"./serve --port=8000 \"$(cat /tmp/port)\"", "exec ./serve --port=8000 \"$(cat /tmp/port)\""},
		{"nohup python3 app.py", "exec nohup python3 app.py"},
		// The last command of top-level lists.
		{"cd /srv && python3 app.py", "cd /srv && exec python3 app.py"},
		{"cd /srv; python3 app.py > log 2>&1", "cd /srv; exec python3 app.py > log 2>&1"},
		{"mkdir -p /run/app\ncd /run/app\nnode server.js\n", "mkdir -p /run/app\ncd /run/app\nexec node server.js\n"},
		{"a && b || c", "a && b || exec c"},
		{"a | b; c", "a | b; exec c"},
		{"X=1; c", "X=1; exec c"},
		// Left to the shell: a builtin last, pipelines, jobs, negation, assignments,
		// builtins and keywords, names that are not plain words, what POSIX sh does not parse,
		// traps, functions, aliases, eval and sourcing.
		{"python3 a.py; echo done", ""},
		{"python3 a.py\necho done", ""},
		{"a | b", ""},
		{"a && ! b", ""},
		{"a & b", ""},
		{"a && b &", ""},
		{"a; b | c", ""},
		{"trap 'rm /tmp/x' EXIT; b", ""},
		{"f() { b; }; f", ""},
		{"alias b=c; b", ""},
		{"eval \"$X\"; b", ""},
		{". /etc/profile; b", ""},
		{"a & wait; b", ""},
		{"if a; then b; fi; c", "if a; then b; fi; exec c"},
		{"a; (b)", ""},
		{"a; cd /x", ""},
		// Where the shells read the line otherwise than a POSIX parse, or run a builtin by
		// another name.
		{"prog # start server \\\ntouch second", ""},
		{"cd /srv # C:\\temp\\\npython3 app.py", ""},
		{"command trap 'touch t' EXIT; prog", ""},
		{"\\trap 'touch t' EXIT; prog", ""},
		{"\"trap\" 'touch t' EXIT; prog", ""},
		{"T=trap; $T 'touch t' EXIT; prog", ""},
		{"command eval 'prog() { touch f; }'; prog", ""},
		{"builtin trap 'x' EXIT; prog", ""},
		{"\\exec prog x", ""},
		{"\\echo 'a\\nb' > f", ""},
		{"true; prog <<EOF\nbody\nEOF\n", ""},
		{"true; prog <<-EOF\n\tbody\n\tEOF\n", ""},
		{"touch a; [[ -n x && -n y ]]", ""},
		{"true; [[ x > y ]]", ""},
		{"coproc sleep 2; prog 2>/dev/null", ""},
		{"touch a; in", ""},
		{"true; -x", ""},
		{"$CC -o x x.c; ./x", ""},
		{"function prog\n{ echo fn >>log; }\nprog", ""},
		{"a+=1 prog", ""},
		{"set -r; prog", ""},
		{"set -o restricted; prog", ""},
		{"set -euo pipefail; prog", "set -euo pipefail; exec prog"},
		{"set -e; prog", "set -e; exec prog"},
		{"enable -n exec; prog", ""},
		{"tra[p] 's' EXIT; prog", ""},
		{"{trap,s,EXIT}; prog", ""},
		{"mapfile -C 'prog(){ :; };:' -c 1 </etc/hostname; prog", ""},
		{"x=$(cat <<E); prog\ntouch f\nE\n", ""},
		{"x=`cat <<E`; prog\ntouch f\nE\n", ""},
		{"cat <<E >o\nx\nE\r\nprog\nE\n", ""},
		{"printf %s $'\\' ; prog $'\\' >f", ""},
		{"prog\r", ""},
		{"~/bin/prog", ""},
		{"python3 app.py &", ""},
		{"! python3 app.py", ""},
		{"PORT=1 python3 app.py", ""},
		{"cd /srv", ""},
		{"echo 'a\\nb'", ""},
		{"printf '%s\\n' x", ""},
		{"[ -f x ]", ""},
		{"exec python3 app.py", ""},
		{"time python3 app.py", ""},
		{"$PY app.py", ""},
		{"'python3' app.py", ""},
		{"(python3 app.py)", ""},
		{"{ python3 app.py; }", ""},
		{"if true; then python3 app.py; fi", ""},
		{"[[ -f x ]] && y", ""},
		{"python3 <<EOF\nprint(1)\nEOF\n", ""},
		{"python3 'unterminated", ""},
		{"", ""},
		{strings.Repeat("x", maxExecRewrite) + " y", ""},
	} {
		want := c.want
		if want == "" {
			want = c.in
		}
		if got := lastExec(c.in, nil); got != want {
			t.Errorf("lastExec(%q) = %q, want %q", c.in, got, want)
		}
	}
	// A /bin/sh that is bash would run an exported function of the program's name.
	if got := lastExec("python3 -c 1", []string{"BASH_FUNC_python3%%=() {  echo f; }"}); got != "python3 -c 1" {
		t.Errorf("with an exported function: %q", got)
	}
}

// FuzzLastExec: a rewrite only ever puts `exec ` before the line's one command, which
// still parses as one simple command.
func FuzzLastExec(f *testing.F) {
	for _, s := range []string{"python3 -c 'x\ny'", "a; b", ">o a b", "# c\na", "a <<E\nx\nE\n"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, cmd string) {
		got := lastExec(cmd, nil)
		if got == cmd {
			return
		}
		i := strings.Index(got, "exec ")
		if i < 0 || got[:i]+got[i+5:] != cmd {
			t.Fatalf("lastExec(%q) = %q: not the line with exec inserted", cmd, got)
		}
		if again := lastExec(got, nil); again != got {
			t.Fatalf("lastExec of its own result %q changed it again: %q", got, again)
		}
	})
}

// BenchmarkLastExec: what the parse adds to a background exec, for a usual line and for the
// costliest lines it takes (deep nesting at maxExecRewrite).
func BenchmarkLastExec(b *testing.B) {
	for _, c := range []struct{ name, cmd string }{
		{"usual", "cd /srv && python3 -c 'import app\napp.serve(port=8000)' > /tmp/app.log 2>&1"},
		{"nested", strings.Repeat("((", maxExecRewrite/2)},
	} {
		b.Run(c.name, func(b *testing.B) {
			for b.Loop() {
				lastExec(c.cmd, nil)
			}
		})
	}
}
