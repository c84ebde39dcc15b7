// The runner behind the Java kernel of the code-interpreter server
// (agentenv.guest.codeint.javakernel): one JVM per context, run from this source file (Java's
// single-file launcher), evaluating cells with JShell's API in its own JVM (an execution engine of
// ours over JShell's DirectExecutionControl, so an expression's value is the object itself, given
// as its toString() as IJava, E2B's Java kernel, gives it).
//
// Requests come on a pipe (the descriptor in AENV_JAVA_REQUEST_FD), one line each: a letter and
// base64 fields. X <code>: run a cell; S <name> <value>...: set system properties for the next cell
// (the earlier values are kept); U: put back what the last S changed; A <name> <value>...: set
// system properties for good. Answers go on another pipe (AENV_JAVA_REPLY_FD), one line each:
// O <text> and E <text>, what the cell wrote to System.out and System.err, one line per write (as
// IJava sends them: println's text and its newline come apart); then D [<text/plain>] when the
// cell is done, or F <name> <value> <traceback> when it failed. READY is the first line.
//
// A SIGINT stops the running cell (Thread.stop of the thread in the user's code, as jshell does).

import java.io.BufferedReader;
import java.io.FileInputStream;
import java.io.FileOutputStream;
import java.io.InputStream;
import java.io.InputStreamReader;
import java.io.OutputStream;
import java.io.PrintStream;
import java.lang.reflect.Method;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Base64;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.stream.Collectors;

import jdk.jshell.Diag;
import jdk.jshell.EvalException;
import jdk.jshell.JShell;
import jdk.jshell.Snippet;
import jdk.jshell.SnippetEvent;
import jdk.jshell.SourceCodeAnalysis;
import jdk.jshell.UnresolvedReferenceException;
import jdk.jshell.VarSnippet;
import jdk.jshell.execution.DirectExecutionControl;
import jdk.jshell.spi.ExecutionControl;
import jdk.jshell.spi.ExecutionControlProvider;
import jdk.jshell.spi.ExecutionEnv;

public class JShellRunner {
    static final Object REPLY_LOCK = new Object();
    static OutputStream replies;

    static String b64(String text) {
        return Base64.getEncoder().encodeToString(text.getBytes(StandardCharsets.UTF_8));
    }

    static String unb64(String text) {
        return new String(Base64.getDecoder().decode(text), StandardCharsets.UTF_8);
    }

    static void reply(String line) {
        synchronized (REPLY_LOCK) {
            try {
                replies.write((line + "\n").getBytes(StandardCharsets.UTF_8));
                replies.flush();
            } catch (java.io.IOException err) {
                Runtime.getRuntime().halt(0); // the kernel is gone
            }
        }
    }

    /** System.out or System.err of the cells: each write is one O or E line. */
    static final class Framed extends OutputStream {
        final String tag;

        Framed(String tag) {
            this.tag = tag;
        }

        @Override
        public void write(int b) {
            write(new byte[] {(byte) b}, 0, 1);
        }

        @Override
        public void write(byte[] data, int off, int len) {
            if (len > 0) {
                reply(tag + " " + Base64.getEncoder().encodeToString(
                        java.util.Arrays.copyOfRange(data, off, off + len)));
            }
        }
    }

    /** Runs the snippets in this JVM, in the thread that evaluates them; keeps the last value. */
    static final class Control extends DirectExecutionControl {
        volatile Thread running;
        Object lastValue;

        @Override
        protected String invoke(Method doit) throws Exception {
            Object value = doit.invoke(null);
            lastValue = value;
            return valueString(value);
        }

        @Override
        public String varValue(String className, String name)
                throws ExecutionControl.RunException, ExecutionControl.EngineTerminationException,
                ExecutionControl.InternalException {
            try {
                java.lang.reflect.Field field = findClass(className).getDeclaredField(name);
                field.setAccessible(true);
                lastValue = field.get(null);
            } catch (ReflectiveOperationException | RuntimeException err) {
                lastValue = null;
            }
            return super.varValue(className, name);
        }

        @Override
        protected void clientCodeEnter() {
            running = Thread.currentThread();
        }

        @Override
        protected void clientCodeLeave() {
            running = null;
        }

        @Override
        @SuppressWarnings("deprecation")
        public void stop() {
            Thread thread = running;
            if (thread != null) {
                thread.stop();
            }
        }
    }

    static final Control CONTROL = new Control();
    static volatile boolean interrupted;

    static final class Provider implements ExecutionControlProvider {
        @Override
        public String name() {
            return "agentenv";
        }

        @Override
        public ExecutionControl generate(ExecutionEnv env, Map<String, String> parameters) {
            return CONTROL;
        }
    }

    static JShell shell;
    static final List<Map<String, String>> saved = new ArrayList<>();

    public static void main(String[] args) throws Exception {
        InputStream requests = new FileInputStream(
                "/proc/self/fd/" + System.getenv("AENV_JAVA_REQUEST_FD"));
        replies = new FileOutputStream("/proc/self/fd/" + System.getenv("AENV_JAVA_REPLY_FD"));
        System.setOut(new PrintStream(new Framed("O"), true, StandardCharsets.UTF_8) {});
        System.setErr(new PrintStream(new Framed("E"), true, StandardCharsets.UTF_8) {});
        System.setIn(InputStream.nullInputStream());
        shell = JShell.builder().executionEngine(new Provider(), Map.of()).build();
        sun.misc.Signal.handle(new sun.misc.Signal("INT"), signal -> {
            interrupted = true;
            CONTROL.stop();
        });
        // the first snippet loads and warms the compiler: paid here, not by the first cell
        shell.eval("0;");
        reply("READY");
        BufferedReader in = new BufferedReader(
                new InputStreamReader(requests, StandardCharsets.UTF_8));
        String line;
        while ((line = in.readLine()) != null) {
            String[] fields = line.split(" ");
            try {
                switch (fields[0]) {
                    case "X" -> execute(unb64(fields[1]));
                    case "S" -> {
                        saved.add(setProperties(fields));
                        reply("D");
                    }
                    case "U" -> {
                        if (!saved.isEmpty()) {
                            restore(saved.remove(saved.size() - 1));
                        }
                        reply("D");
                    }
                    case "A" -> {
                        setProperties(fields);
                        reply("D");
                    }
                    default -> fail("ProtocolError", "unknown request " + fields[0], "");
                }
            } catch (ThreadDeath err) {
                fail("KeyboardInterrupt", "interrupted", "");
            } catch (Throwable err) {
                fail(err.getClass().getName(), String.valueOf(err.getMessage()), stack(err));
            }
        }
        Runtime.getRuntime().halt(0);
    }

    static Map<String, String> setProperties(String[] fields) {
        Map<String, String> before = new HashMap<>();
        for (int i = 1; i + 1 < fields.length; i += 2) {
            String name = unb64(fields[i]);
            if (!before.containsKey(name)) {
                before.put(name, System.getProperty(name));
            }
            System.setProperty(name, unb64(fields[i + 1]));
        }
        return before;
    }

    static void restore(Map<String, String> before) {
        before.forEach((name, value) -> {
            if (value == null) {
                System.clearProperty(name);
            } else {
                System.setProperty(name, value);
            }
        });
    }

    static void fail(String name, String value, String traceback) {
        reply("F " + b64(name) + " " + b64(value) + " " + b64(traceback));
    }

    static String stack(Throwable err) {
        java.io.StringWriter text = new java.io.StringWriter();
        err.printStackTrace(new java.io.PrintWriter(text));
        return text.toString();
    }

    static void execute(String code) {
        interrupted = false;
        Thread.interrupted(); // a stop leaves the thread's interrupt status set: not this cell's
        SourceCodeAnalysis analysis = shell.sourceCodeAnalysis();
        String remaining = code;
        String value = null;
        while (!remaining.isBlank()) {
            SourceCodeAnalysis.CompletionInfo info = analysis.analyzeCompletion(remaining);
            String source;
            if (info.completeness() == SourceCodeAnalysis.Completeness.EMPTY) {
                break;
            } else if (info.completeness().isComplete()) {
                source = info.source();
                remaining = info.remaining();
            } else {
                source = remaining; // incomplete: compiled as it is, for its error
                remaining = "";
            }
            CONTROL.lastValue = null;
            value = null;
            for (SnippetEvent event : shell.eval(source)) {
                if (event.causeSnippet() != null) {
                    continue; // an update of another snippet that depends on this one
                }
                if (interrupted) {
                    fail("KeyboardInterrupt", "interrupted", "");
                    return;
                }
                if (event.exception() != null) {
                    failed(event.exception());
                    return;
                }
                Snippet snippet = event.snippet();
                if (event.status() == Snippet.Status.REJECTED) {
                    rejected(snippet);
                    return;
                }
                if (event.value() != null && isValue(snippet)) {
                    value = String.valueOf(CONTROL.lastValue);
                }
            }
        }
        reply(value == null ? "D" : "D " + b64(value));
    }

    /** An expression's (its value is the cell's), not a declaration's. */
    static boolean isValue(Snippet snippet) {
        if (snippet.kind() == Snippet.Kind.EXPRESSION) {
            return true;
        }
        return snippet instanceof VarSnippet
                && snippet.subKind() == Snippet.SubKind.TEMP_VAR_EXPRESSION_SUBKIND;
    }

    static void failed(jdk.jshell.JShellException err) {
        if (interrupted) {
            fail("KeyboardInterrupt", "interrupted", "");
            return;
        }
        String name;
        if (err instanceof EvalException eval) {
            name = eval.getExceptionClassName();
        } else if (err instanceof UnresolvedReferenceException unresolved) {
            name = "UnresolvedReferenceException";
            String missing = shell.unresolvedDependencies(unresolved.getSnippet())
                    .collect(Collectors.joining(", "));
            fail(name, unresolved.getSnippet().source().strip() + " needs " + missing, "");
            return;
        } else {
            name = err.getClass().getName();
        }
        String message = err.getMessage() == null ? "" : err.getMessage();
        StringBuilder trace = new StringBuilder(name + (message.isEmpty() ? "" : ": " + message));
        for (StackTraceElement frame : err.getStackTrace()) {
            if (frame.getClassName().startsWith("jdk.internal.reflect")
                    || frame.getClassName().startsWith("java.lang.reflect")
                    || frame.getClassName().startsWith("jdk.jshell")
                    || frame.getClassName().equals(JShellRunner.class.getName())
                    || frame.getClassName().startsWith(JShellRunner.class.getName() + "$")) {
                break;
            }
            // (JShell names a cell's frames by their snippet: class "", file "#<snippet id>")
            trace.append("\n\tat ").append(frame.getClassName().isEmpty()
                    ? frame.getMethodName() + "(" + frame.getFileName() + ":"
                      + frame.getLineNumber() + ")"
                    : frame);
        }
        fail(name, message, trace.toString());
    }

    static void rejected(Snippet snippet) {
        String source = snippet.source();
        StringBuilder trace = new StringBuilder();
        List<String> messages = new ArrayList<>();
        shell.diagnostics(snippet).forEach((Diag diag) -> {
            if (!diag.isError()) {
                return;
            }
            String message = diag.getMessage(null);
            messages.add(message);
            int start = (int) Math.max(0, Math.min(diag.getStartPosition(), source.length()));
            int lineStart = source.lastIndexOf('\n', start - 1) + 1;
            int lineEnd = source.indexOf('\n', start);
            String text = source.substring(lineStart, lineEnd < 0 ? source.length() : lineEnd);
            trace.append(message).append('\n').append(text).append('\n')
                    .append(" ".repeat(start - lineStart)).append("^\n");
        });
        if (messages.isEmpty()) {
            messages.add("the snippet was rejected: " + source.strip());
        }
        fail("CompilationException", String.join("\n", messages), trace.toString().strip());
    }
}
