"""The fixed text ``validate`` measures a quantized artifact on (``pipeline.validation.quality``),
written for this project: plain English prose in several registers (an essay, a story, instructions,
a letter, a dialogue, notes on a program), about 2,500 tokens for SmolLM2's tokenizer. It is part of
the code, so every build measures on the same words; changing it changes the measures, and the
bounds in ``conf/quant/`` were calibrated on it (docs/benchmarks.md "quant_quality")."""

TEXT = """\
The River Town

The town of Alder Ford grew up where the old road met the river, at the one place for twenty miles
where a cart could cross in summer without losing a wheel. For most of its history it was a small
place: a mill, two inns, a church with a square tower, and a market that came alive every Thursday
and slept the rest of the week. The river made the town and, every few decades, tried to unmake it.
In wet springs the water rose over the low meadows, crept up the lane past the tannery and stood in
the cellars of the houses nearest the bank. People kept their flour on high shelves and their
firewood on the first floor, and they measured their lives by the floods the way other towns
measure theirs by wars or kings.

The mill was the first building of any size. It was rebuilt three times, once after a fire and twice
after the ice broke the wheel. The miller's family kept a ledger that still survives, and it is a
better history of the town than anything written on purpose. It records the price of grain, the
weddings of the miller's daughters, a dispute with the inn over a horse, and, in a careful hand, the
height of the water on the mill door in each great flood. The marks are still there, cut into the
oak and painted white: 1781, 1824, 1852, and highest of all, 1903, a full hand above the latch.

When the railway came, it did not come to Alder Ford. The engineers chose a line along the ridge to
the north, where the ground was firm and no bridge was needed, and a new station was built two miles
away beside a farm that quickly became a village of its own. For a generation the old town shrank.
The second inn closed, the market moved to the station, and young people left for the cities. What
saved the town in the end was the same river that had always threatened it. Visitors began to arrive
on bicycles and later in motor cars, to walk along the water, to fish below the weir and to eat in
the remaining inn, whose landlord had the good sense to put tables in the garden where guests could
watch the swans.

A Small Story

Mara had been told not to go near the weir, which is why she went there every afternoon after
school. She liked the noise of it, the way the water folded over the edge and turned white, and the
smell of wet stone. She would sit on the wall with her bag beside her and count the ducks, or try to
guess which of the floating leaves would reach the edge first.

One afternoon in October she found an old man sitting in her place. He wore a long coat with too
many pockets and he was holding a notebook on his knee, writing in it with a short pencil.

"You're in my spot," Mara said.

The old man looked up and smiled. "I didn't see a name on it," he said, but he moved along the wall
to make room. "What do you do here?"

"I watch the water. What are you writing?"

"Numbers, mostly. I measure how fast the river runs. I drop a stick in up there," he pointed to a
willow further upstream, "and I time how long it takes to reach the weir. I've done it every week
for forty years."

Mara thought about this. "Why?"

"Because nobody else does. And because if you write something down for long enough, it starts to tell
you things. The river is slower than it was when I was young. Not by much. But it is slower."

She watched him drop the next stick and count under his breath. When it went over the edge he wrote
a number, and she leaned over to see it. The page was full of columns, neat and small, going back to
the top of the page and, she supposed, back through the whole book and all the books before it.

"Can I do the next one?" she asked.

He gave her the pencil.

How to Make Bread at Home

Good bread needs only four things: flour, water, salt and yeast. What it needs most of all is time.
Start the evening before you want to bake. In a large bowl, mix five hundred grams of strong white
flour with ten grams of salt. In a jug, stir three grams of dried yeast into three hundred and fifty
millilitres of water at about the temperature of your hand. Pour the water into the flour and mix
with a spoon until there is no dry flour left. The dough will look rough and sticky; that is as it
should be.

Cover the bowl and leave it for half an hour. Then, with a wet hand, lift one side of the dough,
stretch it up and fold it over the rest. Turn the bowl a quarter of a turn and do it again, four
times in all. Repeat this every half hour for the next two hours. You will feel the dough change
under your hand, becoming smoother, stronger and more elastic. After the last fold, cover the bowl
and put it in the refrigerator overnight. The cold slows the yeast and gives the flavour time to
develop.

In the morning, turn the dough out onto a floured surface and shape it into a round by folding the
edges into the middle and then turning it over. Place it, seam side up, in a bowl lined with a
floured cloth, and let it rise at room temperature for one to two hours, until it has grown by about
half and springs back slowly when you press it with a finger. Meanwhile, heat the oven as hot as it
will go with a heavy pot and its lid inside. Tip the dough into the hot pot, cut a line across the
top with a sharp knife, cover it and bake for twenty minutes. Remove the lid and bake for another
twenty to twenty-five minutes, until the crust is a deep brown. Let the loaf cool for at least an
hour before cutting it, however hard that is.

A Letter

Dear Tom,

Thank you for your letter, which arrived on Tuesday with the rain. I am glad the new job is going
well and that you have found a flat close enough to walk to work. You always said that the best
thing about a city is not needing a car, and now you can prove it.

Things here are much as you left them. The garden has given us more apples than we can eat, and your
mother has been making chutney with a determination that frightens the neighbours. The roof over the
kitchen leaked again in the storm last week. I climbed up and found that a slate had slipped, and I
put it back with a piece of wire, which your grandfather would have approved of and your mother does
not. We will get a builder in the spring.

Your sister came home for the weekend and brought her friend from the university, a quiet young man
who studies the chemistry of soils and who asked so many questions about the orchard that I ran out
of answers. He thinks the old tree by the gate is a variety that nobody grows any more, and he took
some twigs away to graft. If he is right, there may be a little of our garden growing in a research
plot somewhere next year, which pleases me more than I can say.

Write when you can, and come home at Christmas if the trains allow.

With love,
Dad

A Conversation About Maps

"Why do all the old maps put north at the top?"

"They didn't, not always. Plenty of medieval maps put east at the top, because that was the
direction of the sunrise and of Jerusalem. Some Arabic maps put south at the top. North at the top
became a habit later, partly because of the compass and partly because of the printers who copied
each other."

"So it's just a convention."

"Most things on a map are conventions. Blue for water, green for forest, a cross for a church. The
important thing is that the reader and the map maker agree. A map is a kind of promise: if you walk
this way for this long, you will find this. When the promise is broken, people get lost."

"Is a map ever completely accurate?"

"Never. The world is round and the paper is flat, so something has to give. You can keep the shapes
right and get the areas wrong, or keep the areas right and bend the shapes. Every projection is a
choice about which errors you can live with. The map that sailors used for centuries made Greenland
look as big as Africa, but it kept the angles true, and for a navigator steering by compass the
angles were what mattered."

"And the maps on our phones?"

"They are the same kind of choice, made for a different purpose. They care about the street you are
standing on, not about the shape of continents. Zoom out far enough and the old distortions come
back."

Notes on a Small Program

The program reads a list of temperatures from a file, one number per line, and prints the average,
the highest and the lowest value. It is short, but it is worth writing carefully, because small
programs grow into large ones and their habits grow with them.

First, decide what the program should do with bad input. A blank line is easy to skip. A line that
is not a number is harder: the program could skip it silently, stop with an error, or skip it and
report how many lines it skipped. The last choice is usually best. Silently ignoring data makes the
result look more certain than it is, and stopping at the first bad line makes the program useless on
real files, which are never clean.

Second, think about an empty file. The average of no numbers is not zero; it is undefined, and the
program should say so instead of printing a value that looks like a measurement. Third, keep the
reading separate from the arithmetic. A function that takes a list of numbers and returns the three
results can be tested on its own, without any files, and the part that reads the file becomes simple
enough to check by eye.

Finally, write down what the program assumes: that the numbers are in degrees Celsius, that each line
holds one reading, that the order of the lines does not matter. Assumptions that are written down
can be questioned. Assumptions that live only in the head of the person who wrote the code are found
later, usually by someone else, and usually at the worst possible time.

Evening

By the time the light began to go, the wind had dropped and the river was smooth again. The swans
had gone under the bridge to wherever swans go at night, and the lamps were being lit in the inn. A
man was stacking chairs in the garden, and from somewhere up the lane came the sound of a piano,
played slowly, with mistakes, by someone who was still learning. The water went on over the weir as
it always had, carrying the last leaves of the year toward the sea.
"""
