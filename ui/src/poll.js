import { useEffect, useRef, useState } from 'preact/hooks';

// pollInterval is how often the page asks the server again, in milliseconds.
export const pollInterval = 2000;

// usePoll runs load now and every pollInterval while deps stay the same, one call at a
// time. It keeps the last good data while a later call fails, so a view never blanks out.
export function usePoll(load, deps) {
  const [state, setState] = useState({ data: null, error: null, loaded: false });
  const gen = useRef(0);
  useEffect(() => {
    const mine = ++gen.current;
    let timer = null;
    setState({ data: null, error: null, loaded: false });
    const tick = async () => {
      try {
        const data = await load();
        if (gen.current === mine) setState({ data, error: null, loaded: true });
      } catch (err) {
        if (gen.current === mine) setState((s) => ({ ...s, error: err, loaded: true }));
      }
      if (gen.current === mine) timer = setTimeout(tick, pollInterval);
    };
    tick();
    return () => {
      gen.current++;
      clearTimeout(timer);
    };
  }, deps);
  return state;
}
