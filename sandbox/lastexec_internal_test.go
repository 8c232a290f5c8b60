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
		// Left to the shell: several commands, pipelines, jobs, negation, assignments,
		// builtins and keywords, names that are not plain words, what POSIX sh does not parse.
		{"python3 a.py; echo done", ""},
		{"python3 a.py\necho done", ""},
		{"a | b", ""},
		{"a && b", ""},
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
		{"python3 <<EOF\nprint(1)\nEOF\n", "exec python3 <<EOF\nprint(1)\nEOF\n"},
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
