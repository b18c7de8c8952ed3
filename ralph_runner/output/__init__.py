"""What the operator sees of a run, in one style: `bus` hands each event to the followers and
the console; `console` shows it (readable lines on rich's terminal handling, or JSON lines);
`lines` says each event in words; `text` makes tables, counts and cut lines; `durations` says
every span of time, in the few formats that differ on purpose."""
